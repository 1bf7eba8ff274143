"""Request bodies of the OpenAI API, validated into one frozen ``GenerationRequest``.

Validation is strict where a silent fallback would surprise: a wrong type, an
out-of-range value, an unknown or unsupported parameter is a 400 naming the
parameter (``param``), before anything reaches a replica. Messages, ``tools``,
``tool_choice`` and ``response_format`` go through the worker's own checks
(app/contract/engine_inputs.py), to the depth the engines read them: the gateway admits
nothing a worker or engine would refuse (DESIGN.md §13).
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
from app.contract.vllm_extras import LEGACY_GUIDED, SAMPLING_EXTRAS, check_sampling_extras, structured_outputs_of
from app.driver.request import CHAT, GenerationRequest

_COMMON = {
    "model",
    "stream",
    "stream_options",
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "user",
    "ignore_eos",  # vLLM's: generate max_tokens whatever the model says (benchmarks, long tests)
    *SAMPLING_EXTRAS,  # vLLM's other sampling extras and its structured outputs (app/contract/vllm_extras.py)
    "structured_outputs",
    *LEGACY_GUIDED,
}
CHAT_FIELDS = _COMMON | {
    "messages",
    "max_completion_tokens",
    "tools",
    "tool_choice",
    "response_format",
    "logprobs",
    "top_logprobs",
}
COMPLETION_FIELDS = _COMMON | {"prompt", "logprobs"}
# Parameters of the OpenAI API that phasegate knows and deliberately does not serve.
UNSUPPORTED = {
    "logit_bias",
    "functions",
    "function_call",
    "audio",
    "modalities",
    "prediction",
    "parallel_tool_calls",
    "store",
    "metadata",
    "service_tier",
    "best_of",
    "echo",
    "suffix",
    "web_search_options",
    "reasoning_effort",
}
MAX_N = 8
MAX_STOP = 4


def parse_request(endpoint: str, body: Any, limits: Limits) -> GenerationRequest:
    """Validate a decoded JSON body for ``endpoint`` (CHAT or COMPLETIONS)."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    allowed = CHAT_FIELDS if endpoint == CHAT else COMPLETION_FIELDS
    for name in body:
        if name in UNSUPPORTED:
            raise UnsupportedParameter(f"phasegate does not support '{name}'", param=name)
        if name not in allowed:
            raise UnsupportedParameter(f"unrecognized request argument supplied: {name}", param=name)
    model = _required(body, "model", str)
    if not model:
        raise InvalidRequest("'model' must not be empty", param="model")
    stream = _optional(body, "stream", bool, False)
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise InvalidRequest("'stream_options' is only allowed when 'stream' is true", param="stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise InvalidRequest("'stream_options' takes only 'include_usage'", param="stream_options")
        include_usage = _optional(options, "include_usage", bool, False, param="stream_options.include_usage")
    max_tokens = _max_tokens(body, limits)
    common: dict[str, Any] = {
        "endpoint": endpoint,
        "model": model,
        "stream": stream,
        "include_usage": include_usage,
        "max_tokens": max_tokens,
        "temperature": _number(body, "temperature", 1.0, 0.0, 2.0),
        "top_p": _number(body, "top_p", 1.0, 0.0, 1.0, open_low=True),
        "n": _integer(body, "n", 1, 1, MAX_N),
        "stop": _stop(body),
        "seed": _seed(body),
        "presence_penalty": _number(body, "presence_penalty", 0.0, -2.0, 2.0),
        "frequency_penalty": _number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        "user": _optional(body, "user", str, None),
        "ignore_eos": _optional(body, "ignore_eos", bool, False),
        "raw": body,
    }
    with _engine_rules():
        common["sampling_extras"] = check_sampling_extras(body, max_tokens)
        common["structured_outputs"] = structured_outputs_of(body)
        common["logprobs"] = requested_logprobs(body, chat=endpoint == CHAT)
    if endpoint == CHAT:
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
    return GenerationRequest(**common, prompt=_prompt(body))


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


def _number(
    body: dict[str, Any], name: str, default: float, low: float, high: float, *, open_low: bool = False
) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidRequest(f"'{name}' must be a number", param=name)
    if value > high or value < low or (open_low and value == low):
        bound = f"({low}" if open_low else f"[{low}"
        raise InvalidRequest(f"'{name}' must be in {bound}, {high}]", param=name)
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


def _max_tokens(body: dict[str, Any], limits: Limits) -> int:
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    value = _optional(body, name, int, None)
    if value is None:
        return min(limits.default_max_tokens, limits.max_tokens)
    if not 1 <= value <= limits.max_tokens:
        raise InvalidRequest(f"'{name}' must be between 1 and {limits.max_tokens}", param=name)
    return int(value)


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise InvalidRequest("'stop' must be a non-empty string or an array of them", param="stop")
    if len(value) > MAX_STOP:
        raise InvalidRequest(f"'stop' takes at most {MAX_STOP} sequences", param="stop")
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


def _prompt(body: dict[str, Any]) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]  # a batch of one is one prompt
    if isinstance(prompt, list):
        raise UnsupportedParameter("a batch of prompts is not supported; send one prompt a request", param="prompt")
    if not isinstance(prompt, str) or not prompt:
        raise InvalidRequest("'prompt' is required and must be a non-empty string", param="prompt")
    return prompt
