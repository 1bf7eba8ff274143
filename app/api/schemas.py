"""Request bodies of the OpenAI API, validated into one frozen ``GenerationRequest``.

The fields are those ``vllm serve`` takes (app/contract/request_fields.py, DESIGN.md
§14): a field is passed on as the client sent it, or refused as phasegate's own with why;
none is filled in that the client did not send. A wrong type or an out-of-range value of
a field phasegate reads or types is a 400 naming the parameter (``param``), before
anything reaches a replica. Messages, ``tools``, ``tool_choice`` and ``response_format``
go through the worker's own checks (app/contract/engine_inputs.py), to the depth the
engines read them: the gateway admits nothing a worker or engine would refuse with a 5xx
(DESIGN.md §13).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

from app.api.errors import InvalidRequest, UnsupportedParameter
from app.config import Limits
from app.contract.engine_inputs import BadInput, check_message, check_response_format, check_tool_choice, check_tools
from app.contract.logprobs import requested_logprobs
from app.contract.request_fields import FIELD_TYPES, OWN, WHOLE_ONLY
from app.contract.vllm_extras import check_sampling_extras, structured_outputs_of
from app.driver.request import CHAT, GenerationRequest

MAX_METADATA_KEYS = 16  # OpenAI's shape for metadata, which the log records (docs/compatibility.md)
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


def parse_request(endpoint: str, body: Any, limits: Limits) -> GenerationRequest:
    """Validate a decoded JSON body for ``endpoint`` (CHAT or COMPLETIONS).

    The fields are vLLM's (app/contract/request_fields.py): phasegate's own are refused
    with why, the ones phasegate reads are checked here, and every other is passed on to
    the replica as the client sent it; a field the client did not send is not sent on."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    for name in body:
        if name in OWN:
            raise UnsupportedParameter(f"'{name}' is set by phasegate, not by a client: {OWN[name]}", param=name)
        if name in WHOLE_ONLY and body[name] is not None:
            raise UnsupportedParameter(f"'{name}' is not served through phasegate: {WHOLE_ONLY[name]}", param=name)
    chat = endpoint == CHAT
    model = _required(body, "model", str)
    if not model:
        raise InvalidRequest("'model' must not be empty", param="model")
    stream = _optional(body, "stream", bool, False)
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise InvalidRequest("'stream_options' is only allowed when 'stream' is true", param="stream_options")
        if not isinstance(options, dict):
            raise InvalidRequest("'stream_options' must be an object", param="stream_options")
        include_usage = _optional(options, "include_usage", bool, False, param="stream_options.include_usage")
        _optional(options, "continuous_usage_stats", bool, False, param="stream_options.continuous_usage_stats")
    max_tokens = _max_tokens(body, limits)
    _check_types(body)
    common: dict[str, Any] = {
        "endpoint": endpoint,
        "model": model,
        "stream": stream,
        "include_usage": include_usage,
        "max_tokens": max_tokens,
        "temperature": _number(body, "temperature", 0.0, math.inf),
        "top_p": _number(body, "top_p", 0.0, 1.0, open_low=True),
        "n": _integer(body, "n", 1, 1, limits.max_n),
        "stop": _stop(body),
        "seed": _seed(body),
        "presence_penalty": _number(body, "presence_penalty", -2.0, 2.0),
        "frequency_penalty": _number(body, "frequency_penalty", -2.0, 2.0),
        "user": _optional(body, "user", str, None),
        "ignore_eos": _optional(body, "ignore_eos", bool, False),
        "metadata": _metadata(body),
        "raw": body,
    }
    with _engine_rules():
        common["sampling_extras"] = check_sampling_extras(body, max_tokens)
        common["structured_outputs"] = structured_outputs_of(body)
        common["logprobs"] = requested_logprobs(body, chat=chat)
    if chat:
        tools = _tools(body)
        response_format = _response_format(body)
        if common["structured_outputs"] is not None and response_format and response_format["type"] != "text":
            raise InvalidRequest("give response_format or structured outputs, not both", param="response_format")
        return GenerationRequest(
            **common,
            messages=_messages(body),
            tools=tools,
            tool_choice=_tool_choice(body, tools),
            response_format=response_format,
        )
    prompt, prompts = _prompt(body)
    return GenerationRequest(**common, prompt=prompt, prompts=prompts)


# --- fields ------------------------------------------------------------------------------


def _type_name(expected: type) -> str:
    return {str: "a string", bool: "a boolean", int: "an integer", list: "an array", dict: "an object"}[expected]


def _is(value: Any, expected: type) -> bool:
    # JSON true is not an integer here, though Python thinks so
    return isinstance(value, expected) and not (expected is int and isinstance(value, bool))


def _required(body: dict[str, Any], name: str, expected: type) -> Any:
    if name not in body:
        raise InvalidRequest(f"'{name}' is required", param=name)
    return _optional(body, name, expected, None)


def _optional(body: dict[str, Any], name: str, expected: type, default: Any, *, param: str | None = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not _is(value, expected):
        raise InvalidRequest(f"'{param or name}' must be {_type_name(expected)}", param=param or name)
    return value


def _number(body: dict[str, Any], name: str, low: float, high: float, *, open_low: bool = False) -> float | None:
    """A number the client may give (``None`` when it gave none: the replica's default applies)."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidRequest(f"'{name}' must be a number", param=name)
    if value > high or value < low or (open_low and value == low):
        bound = f"({low}" if open_low else f"[{low}"
        shown = f"{bound}, {high}]" if math.isfinite(high) else f"at least {low}"
        raise InvalidRequest(f"'{name}' must be {'in ' if math.isfinite(high) else ''}{shown}", param=name)
    return float(value)


def _integer(body: dict[str, Any], name: str, default: int, low: int, high: int) -> int:
    value = _optional(body, name, int, default)
    if not low <= value <= high:
        raise InvalidRequest(f"'{name}' must be between {low} and {high}", param=name)
    return int(value)


def _seed(body: dict[str, Any]) -> int | None:
    seed = _optional(body, "seed", int, None)
    if seed is not None and not -(2**63) <= seed < 2**63:  # what the log (bigint) and the engines hold
        raise InvalidRequest("'seed' must be a 64-bit signed integer", param="seed")
    return seed  # type: ignore[no-any-return]


def _max_tokens(body: dict[str, Any], limits: Limits) -> int | None:
    """The tokens the client asked for at most; ``None``: vLLM's default (the rest of the
    model's context), unless the operator set a default. The operator's limit, if any, holds."""
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    value = _optional(body, name, int, None)
    if value is None:
        return limits.default_max_tokens
    ceiling = limits.max_tokens
    if value < 1 or (ceiling is not None and value > ceiling):
        bound = f"between 1 and {ceiling}" if ceiling is not None else "at least 1"
        raise InvalidRequest(f"'{name}' must be {bound}", param=name)
    return int(value)


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise InvalidRequest("'stop' must be a string or an array of them", param="stop")
    return tuple(value)


def _messages(body: dict[str, Any]) -> tuple[dict[str, Any], ...]:
    messages = _required(body, "messages", list)
    if not messages:
        raise InvalidRequest("'messages' must not be empty", param="messages")
    with _engine_rules():
        for index, message in enumerate(messages):
            check_message(message, f"messages[{index}]")
    return tuple(messages)


def _tools(body: dict[str, Any]) -> tuple[dict[str, Any], ...]:
    if body.get("tools") is None:
        return ()
    with _engine_rules():
        return check_tools(body["tools"])


def _tool_choice(body: dict[str, Any], tools: tuple[dict[str, Any], ...]) -> str | dict[str, Any] | None:
    if body.get("tool_choice") is None:
        return None
    with _engine_rules():
        return check_tool_choice(body["tool_choice"], tools)


def _response_format(body: dict[str, Any]) -> dict[str, Any] | None:
    if body.get("response_format") is None:
        return None
    with _engine_rules():
        return check_response_format(body["response_format"])


@contextlib.contextmanager
def _engine_rules() -> Iterator[None]:
    """The checks both sides share (app/contract/engine_inputs.py), as the client's 400 naming the param."""
    try:
        yield
    except BadInput as bad:
        raise InvalidRequest(str(bad), param=bad.param) from None


def _prompt(body: dict[str, Any]) -> tuple[str | None, int]:
    """The prompt as text (``None`` for token ids) and how many prompts it is: a string, an
    array of strings, an array of token ids or an array of those (vLLM's forms); or no
    prompt but ``prompt_embeds`` (base64 tensors, one or a list), passed on unread."""
    prompt = body.get("prompt")
    embeds = body.get("prompt_embeds")
    if prompt is None and isinstance(embeds, str | list) and embeds:
        return None, len(embeds) if isinstance(embeds, list) else 1
    if isinstance(prompt, str) and prompt:
        return prompt, 1
    if isinstance(prompt, list) and prompt:
        if all(isinstance(item, str) and item for item in prompt):
            return ("".join(prompt) if len(prompt) == 1 else None), len(prompt)
        if all(_is(item, int) and item >= 0 for item in prompt):
            return None, 1
        if all(isinstance(ids, list) and ids and all(_is(i, int) and i >= 0 for i in ids) for ids in prompt):
            return None, len(prompt)
    raise InvalidRequest(
        "'prompt' is required: a non-empty string, an array of them, an array of token ids, or an array of those",
        param="prompt",
    )


def _metadata(body: dict[str, Any]) -> dict[str, str] | None:
    """Recorded in the log, for audit queries: OpenAI's shape (string keys and values)."""
    value = body.get("metadata")
    if value is None:
        return None
    if (
        not isinstance(value, dict)
        or len(value) > MAX_METADATA_KEYS
        or not all(isinstance(k, str) and len(k) <= MAX_METADATA_KEY_CHARS for k in value)
        or not all(isinstance(v, str) and len(v) <= MAX_METADATA_VALUE_CHARS for v in value.values())
    ):
        raise InvalidRequest(
            f"'metadata' must be an object of at most {MAX_METADATA_KEYS} strings "
            f"(keys up to {MAX_METADATA_KEY_CHARS} characters, values up to {MAX_METADATA_VALUE_CHARS})",
            param="metadata",
        )
    return dict(value)


def _check_types(body: dict[str, Any]) -> None:
    """The JSON type of each passed-on field phasegate does not read itself, as vLLM declares it."""
    for name, kind in FIELD_TYPES.items():
        value = body.get(name)
        if value is not None and not kind.check(value):
            raise InvalidRequest(f"'{name}' must be {kind.what}", param=name)
