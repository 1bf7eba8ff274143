"""Request bodies of the OpenAI API, validated into one frozen ``GenerationRequest``.

The fields are those ``vllm serve`` takes, declared with their types and ranges in
app/contract/requests.py (the same models describe them in ``/openapi.json``): a field is
passed on as the client sent it, or refused as phasegate's own with why
(app/contract/request_fields.py, docs/design.md §14); none is filled in that the client did not
send. A wrong type or an out-of-range value is a 400 naming the parameter (``param``),
before anything reaches a replica; so are the rules no type says, checked here. Messages,
``tools``, ``tool_choice`` and ``response_format`` are declared to the depth the engines
read them (app/contract/engine_inputs.py, the worker's own checks): the gateway admits
nothing a worker or engine would refuse with a 5xx (docs/design.md §13).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping
from typing import Any

from app.api.errors import InvalidRequest, UnsupportedParameter
from app.config import Limits
from app.contract.declared import BadInput, NotServed, checked
from app.contract.engine_inputs import choice_among
from app.contract.logprobs import requested_logprobs, requested_prompt_logprobs
from app.contract.request_fields import OWN, WHOLE_ONLY
from app.contract.requests import PROMPT_FORMS, ChatCompletionRequest, CompletionRequest, request_models
from app.driver.request import CHAT, GenerationRequest


def parse_translated_chat(chat: dict[str, Any], limits: Limits, client_names: Mapping[str, str]) -> GenerationRequest:
    """A chat completion translated from another API's body (Responses, Messages),
    validated as chat; a refusal names the field as that API's client sent it
    (``client_names``: the chat field's name to the client's), and a tool's path without
    the chat API's ``function`` object, which those APIs' tools do not have."""
    try:
        return parse_request(CHAT, chat, limits)
    except InvalidRequest as error:
        if error.param is not None:
            name = re.split(r"[.\[]", error.param, maxsplit=1)[0]
            if name in client_names:
                error.message = error.message.replace(name, client_names[name])
                error.param = client_names[name]
            elif name in ("tools", "tool_choice"):
                error.message = error.message.replace(error.param, error.param.replace(".function", ""))
                error.param = error.param.replace(".function", "")
        raise


def parse_request(endpoint: str, body: Any, limits: Limits) -> GenerationRequest:
    """Validate a decoded JSON body for ``endpoint`` (CHAT or COMPLETIONS).

    The fields are vLLM's (app/contract/requests.py): phasegate's own are refused with
    why, every field is checked against its declaration, and every field but phasegate's
    own is passed on to the replica as the client sent it; a field the client did not
    send is not sent on."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    for name in body:
        if name in OWN:
            raise UnsupportedParameter(f"'{name}' is set by phasegate, not by a client: {OWN[name]}", param=name)
        if name in WHOLE_ONLY and body[name] is not None:
            raise UnsupportedParameter(f"'{name}' is not served through phasegate: {WHOLE_ONLY[name]}", param=name)
    chat = endpoint == CHAT
    chat_model, completion_model = request_models(limits.max_tokens, limits.max_n)
    with as_refusal():
        declared = checked((chat_model if chat else completion_model).model_validate, body)
        stream = bool(declared.stream)
        if declared.stream_options is not None and not stream:
            raise BadInput("stream_options", "is only allowed when 'stream' is true")
        given = declared.max_tokens
        if isinstance(declared, ChatCompletionRequest) and declared.max_completion_tokens is not None:
            given = declared.max_completion_tokens  # the newer name wins, as in vLLM
        max_tokens = limits.default_max_tokens if given is None else given
        common: dict[str, Any] = {
            "endpoint": endpoint,
            "model": declared.model,
            "stream": stream,
            "include_usage": bool(declared.stream_options and declared.stream_options.include_usage),
            "max_tokens": max_tokens,
            "temperature": declared.temperature,
            "top_p": declared.top_p,
            "n": 1 if declared.n is None else declared.n,
            "stop": _stop(declared.stop),
            "seed": declared.seed,
            "presence_penalty": declared.presence_penalty,
            "frequency_penalty": declared.frequency_penalty,
            "user": declared.user,
            "ignore_eos": bool(declared.ignore_eos),
            "metadata": body.get("metadata"),
            "raw": body,
            "sampling_extras": declared.extras(max_tokens),
            "structured_outputs": declared.constraint(),
            "logprobs": requested_logprobs(body, chat=chat),
            "return_token_ids": body.get("return_token_ids") is True,
            "prompt_logprobs": requested_prompt_logprobs(body, chat=chat, stream=stream),
            "continuous_usage": bool(
                declared.stream_options
                and declared.stream_options.include_usage
                and declared.stream_options.continuous_usage_stats
            ),
        }
        if not chat:
            assert isinstance(declared, CompletionRequest)
            prompt, prompts = _prompt(declared)
            return GenerationRequest(**common, prompt=prompt, prompts=prompts)
        tools = tuple(body.get("tools") or ())
        choice_among(body.get("tool_choice"), [tool["function"]["name"] for tool in tools])
        response_format = body.get("response_format")
        if common["structured_outputs"] is not None and response_format and response_format["type"] != "text":
            raise BadInput("response_format", "cannot be given with structured outputs: give one, not both")
        return GenerationRequest(
            **common,
            messages=tuple(body["messages"]),
            tools=tools,
            tool_choice=body.get("tool_choice"),
            response_format=response_format,
        )


@contextlib.contextmanager
def as_refusal() -> Iterator[None]:
    """A problem with the request (app/contract/declared.py), as the client's 400 naming
    the param: ``unsupported_parameter`` for a value phasegate does not serve."""
    try:
        yield
    except BadInput as bad:
        kind = UnsupportedParameter if isinstance(bad, NotServed) else InvalidRequest
        raise kind(str(bad), param=bad.param) from None


def _stop(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def _prompt(declared: CompletionRequest) -> tuple[str | None, int]:
    """The prompt as text (``None`` for token ids) and how many prompts it is: a string, an
    array of strings, an array of token ids or an array of those (vLLM's forms); or no
    prompt but ``prompt_embeds`` (base64 tensors, one or a list), passed on unread."""
    prompt, embeds = declared.prompt, declared.prompt_embeds
    if prompt is None:
        if embeds is None:
            raise BadInput("prompt", f"is required: {PROMPT_FORMS}")
        return None, len(embeds) if isinstance(embeds, list) else 1
    if isinstance(prompt, str):
        return prompt, 1
    if all(isinstance(item, str) for item in prompt):
        return ("".join(prompt) if len(prompt) == 1 else None), len(prompt)  # type: ignore[arg-type]
    return None, len(prompt) if isinstance(prompt[0], list) else 1
