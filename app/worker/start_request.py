"""A start request's body parsed into an :class:`~app.worker.protocol.AttemptSpec`: which
fields it may carry, its prompts or messages, and its sampling parameters checked for sense
(app/worker/protocol.py holds the vocabulary: the spec, the codes, the field checks).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from app.contract.declared import BadInput
from app.contract.engine_inputs import check_message, check_response_format, check_tool_choice, check_tools
from app.contract.logprobs import requested_logprobs
from app.contract.pooling import ROUTES as POOLING_ROUTES
from app.contract.vllm_extras import SAMPLING_EXTRAS, check_sampling_extras, check_structured_outputs
from app.worker.protocol import AttemptSpec, Code, Refusal, Sampling, invalid, no_unknown, number, required, text, whole

SAMPLING_FIELDS = frozenset(
    {
        "temperature",
        "top_p",
        "max_tokens",
        "stop",
        "seed",
        "n",
        "tools",
        "tool_choice",
        "response_format",
        "ignore_eos",
        "presence_penalty",
        "frequency_penalty",
        *SAMPLING_EXTRAS,
        "structured_outputs",
        "logprobs",
        "top_logprobs",
    }
)
START_FIELDS = frozenset(
    {
        "pooling",
        "request_id",
        "attempt",
        "lease_epoch",
        "lease_ttl_ms",
        "model",
        "messages",
        "prompt",
        "params",
        "vllm",
        "heartbeat_ms",
        "prompt_logprobs",
    }
)
MAX_N = 16
MAX_STOP = 16


def parse_start(body: Mapping[str, Any], *, default_heartbeat_s: float) -> AttemptSpec:
    """The body of a start request; raises :class:`Refusal` naming the first bad field."""
    no_unknown(body, START_FIELDS, "")
    request_id = text(required(body, "request_id"), "request_id")
    attempt = whole(required(body, "attempt"), "attempt", 1, 1_000_000)
    lease_epoch = whole(required(body, "lease_epoch"), "lease_epoch", 0, 2**62)
    lease_ttl_s = whole(required(body, "lease_ttl_ms"), "lease_ttl_ms", 50, 600_000) / 1000
    model = text(required(body, "model"), "model")
    messages, prompt = body.get("messages"), body.get("prompt")
    fields = body.get("vllm")
    if fields is not None and not isinstance(fields, dict):
        raise invalid("vllm", "must be an object")
    pooling = body.get("pooling")
    if pooling is not None and pooling not in POOLING_ROUTES:
        raise invalid("pooling", f"must be one of {', '.join(POOLING_ROUTES)}")
    if pooling is not None and (messages is not None or prompt is not None):
        raise invalid("pooling", "a pooling request's input is in vllm, not in messages or prompt")
    if pooling is not None:
        messages, prompt = None, None
    elif messages is None and prompt is None and fields and fields.get("prompt_embeds") is not None:
        why = "prompt_embeds: the worker takes a prompt as text or token ids, not as embeddings"
        raise Refusal(400, Code.UNSUPPORTED_FIELD, why, field="prompt_embeds")
    if messages is None and prompt is None and pooling is None:
        raise Refusal(400, Code.MISSING_FIELD, "one of messages or prompt is required", field="messages")
    if messages is not None and prompt is not None:
        raise invalid("prompt", "give messages or prompt, not both")
    batch = _prompts(prompt) if prompt is not None else ()
    heartbeat_s = default_heartbeat_s
    if body.get("heartbeat_ms") is not None:
        heartbeat_s = whole(body["heartbeat_ms"], "heartbeat_ms", 10, 10_000) / 1000
    prompt_logprobs = body.get("prompt_logprobs")  # a whole answer's (docs/worker-protocol.md)
    if prompt_logprobs is not None:
        prompt_logprobs = whole(prompt_logprobs, "prompt_logprobs", -1, 2**31 - 1)
    params = body.get("params") or {}
    if not isinstance(params, dict):
        raise invalid("params", "must be an object")
    return AttemptSpec(
        request_id=request_id,
        attempt=attempt,
        lease_epoch=lease_epoch,
        lease_ttl_s=lease_ttl_s,
        model=model,
        messages=None if messages is None else _messages(messages),
        prompt=batch[0] if batch else None,
        sampling=parse_sampling(params),
        heartbeat_s=heartbeat_s,
        fields=params if fields is None else fields,
        batch=batch if len(batch) > 1 else (),
        pooling=pooling,
        prompt_logprobs=None if pooling is not None else prompt_logprobs,
    )


def _prompts(value: Any) -> tuple[str | tuple[int, ...], ...]:
    """A completion's prompts: a string or token ids, or a batch of them (as vLLM's server
    takes them: a list of strings, or of token-id lists)."""
    if isinstance(value, list) and value and all(isinstance(p, str | list) for p in value):
        return tuple(_one_prompt(p) for p in value)
    return (_one_prompt(value),)


def _one_prompt(value: Any) -> str | tuple[int, ...]:
    if isinstance(value, str) and value:
        return value
    if (
        isinstance(value, list)
        and value
        and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value)
    ):
        return tuple(value)
    raise invalid("prompt", "must be a non-empty string, a list of token ids, or a batch of them")


def _messages(value: Any) -> tuple[dict[str, Any], ...]:
    if not isinstance(value, list) or not value:
        raise invalid("messages", "must be a non-empty list")
    for i, message in enumerate(value):
        try:
            check_message(message, f"messages[{i}]")
        except BadInput as bad:
            raise invalid(bad.param, bad.why) from None
    return tuple(value)


def parse_sampling(params: Mapping[str, Any]) -> Sampling:
    no_unknown(params, SAMPLING_FIELDS, "params.")
    p = "params."
    out: dict[str, Any] = {}
    if params.get("max_tokens") is not None:
        out["max_tokens"] = whole(params["max_tokens"], p + "max_tokens", 1, 1_000_000)
    if params.get("temperature") is not None:
        out["temperature"] = number(params["temperature"], p + "temperature", 0.0, 100.0)
    if params.get("top_p") is not None:
        out["top_p"] = number(params["top_p"], p + "top_p", 0.0, 1.0, low_open=True)
    for name in ("presence_penalty", "frequency_penalty"):
        if params.get(name) is not None:
            out[name] = number(params[name], p + name, -2.0, 2.0)
    if params.get("seed") is not None:
        out["seed"] = whole(params["seed"], p + "seed", -(2**63), 2**63 - 1)
    if params.get("n") is not None:
        out["n"] = whole(params["n"], p + "n", 1, MAX_N)
    if params.get("ignore_eos") is not None:
        if not isinstance(params["ignore_eos"], bool):
            raise invalid(p + "ignore_eos", "must be a boolean")
        out["ignore_eos"] = params["ignore_eos"]
    stop = params.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or len(stops) > MAX_STOP or not all(isinstance(s, str) and s for s in stops):
            raise invalid(p + "stop", f"must be a non-empty string or a list of at most {MAX_STOP} of them")
        out["stop"] = tuple(stops)
    try:
        if params.get("tools") is not None:
            out["tools"] = check_tools(params["tools"])
        if params.get("tool_choice") is not None:
            out["tool_choice"] = check_tool_choice(params["tool_choice"], out.get("tools", ()))
        if params.get("response_format") is not None:
            out["response_format"] = check_response_format(params["response_format"])
        out.update(check_sampling_extras(params, out.get("max_tokens")))
        if params.get("structured_outputs") is not None:
            if out.get("response_format", {}).get("type", "text") != "text":
                raise BadInput("structured_outputs", "cannot be combined with a response_format")
            out["structured_outputs"] = check_structured_outputs(params["structured_outputs"])
        out["logprobs"] = requested_logprobs(params, chat=None)
    except BadInput as bad:
        raise invalid(p + bad.param, bad.why) from None
    return Sampling(**out)
