"""The worker protocol's vocabulary: error codes and request parsing.

Everything the worker reads from the network (once ``json_body.py`` decoded it) is
parsed here into frozen dataclasses, and every refusal is a :class:`Refusal` with an HTTP status and
a stable code from :class:`Code`; its frames are in ``frame_encoders.py`` (``docs/worker-protocol.md``).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from app.contract.declared import BadInput
from app.contract.engine_inputs import check_message, check_response_format, check_tool_choice, check_tools
from app.contract.logprobs import requested_logprobs
from app.contract.pooling import ROUTES as POOLING_ROUTES
from app.contract.vllm_extras import SAMPLING_EXTRAS, check_sampling_extras, check_structured_outputs


class Code(enum.StrEnum):
    """Stable error codes: in HTTP error bodies and in ``error`` frames."""

    # the request itself (4xx)
    INVALID_JSON = "invalid_json"
    MISSING_FIELD = "missing_field"
    INVALID_FIELD = "invalid_field"
    UNKNOWN_FIELD = "unknown_field"
    UNSUPPORTED_FIELD = "unsupported_parameter"  # known, valid, and not served by this worker
    UNKNOWN_MODEL = "unknown_model"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # app/contract/refusal_codes.py
    BAD_REQUEST = "upstream_bad_request"  # vLLM's request checks refused it: its message says why
    UNKNOWN_ATTEMPT = "unknown_attempt"
    DUPLICATE_ATTEMPT = "duplicate_attempt"
    ATTEMPT_CANCELLED = "attempt_cancelled"
    ATTEMPT_ENDED = "attempt_ended"
    STALE_LEASE_EPOCH = "stale_lease_epoch"
    LEASE_EXPIRED = "lease_expired"
    FAULTS_DISABLED = "faults_disabled"
    BODY_TOO_LARGE = "body_too_large"  # 413: over --max-body-bytes
    UNAUTHORIZED = "unauthorized"  # 401: no or a wrong worker token
    CLIENT_GONE = "client_closed_request"  # 499: the caller left mid-body (nobody reads it)
    NOT_FOUND = "not_found"  # 404: no such endpoint
    METHOD_NOT_ALLOWED = "method_not_allowed"  # 405: the endpoint takes other methods (Allow)
    NOT_SERVED = "not_served_by_engine"  # 501: a vLLM route the engine has nothing for (the sim's tokenizer)
    # the replica (429 / 5xx)
    QUEUE_FULL = "queue_full"
    REPLICA_EXITING = "replica_exiting"
    NOT_READY = "not_ready"
    ENGINE_UNHEALTHY = "engine_unhealthy"
    ABORT_UNCONFIRMED = "abort_unconfirmed"
    PROTOCOL_MISMATCH = "protocol_mismatch"  # 503: the caller names another protocol version
    INTERNAL_ERROR = "internal_error"
    # error frames only: why the worker ended a started attempt
    LEASE_REVOKED = "lease_revoked"
    CANCELLED = "cancelled"
    ENGINE_ERROR = "engine_error"


class Refusal(Exception):
    """A request the worker will not serve; becomes a JSON error response."""

    def __init__(
        self,
        status: int,
        code: Code,
        message: str,
        *,
        field: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.field = field
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        error: dict[str, Any] = {"code": self.code.value, "message": self.message}
        if self.field is not None:
            error["field"] = self.field
        return {"error": error}


# --- requests ----------------------------------------------------------------------------

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
    }
)
MAX_N = 16
MAX_STOP = 16


@dataclass(frozen=True, slots=True)
class Sampling:
    """OpenAI-style sampling parameters, checked for sense (not for the model's limits)."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    n: int = 1
    tools: tuple[dict[str, Any], ...] = ()
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    top_k: int | None = None  # vLLM's extras (app/contract/vllm_extras.py); None: the engine's default
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    structured_outputs: dict[str, Any] | None = None
    logprobs: int | None = None  # alternatives wanted at each token (app/contract/logprobs.py)

    def tool_names(self) -> list[str]:
        return [tool["function"]["name"] for tool in self.tools]


@dataclass(frozen=True, slots=True)
class AttemptSpec:
    """A parsed start request: which attempt, under which lease, generating what."""

    request_id: str
    attempt: int
    lease_epoch: int
    lease_ttl_s: float
    model: str
    messages: tuple[dict[str, Any], ...] | None
    prompt: str | tuple[int, ...] | None  # a completion's prompt: its text, or its token ids
    sampling: Sampling
    heartbeat_s: float
    # the request's fields as vLLM's server takes them: the start request's ``vllm``, else
    # its ``params`` (app/worker/vllm_requests.py); the sim reads ``sampling`` only
    fields: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # a completion's batch of prompts, ``prompt`` the first (empty: one prompt); prompt k's
    # choices are k·n … k·n + n − 1, as vLLM's server numbers them
    batch: tuple[str | tuple[int, ...], ...] = ()
    # a pooling request's route (docs/design.md §17): its input is in ``fields``, its answer
    # one done frame; None for a generation
    pooling: str | None = None

    @property
    def choices(self) -> int:
        """The answer's choices: ``n`` for each prompt."""
        return self.sampling.n * max(len(self.batch), 1)

    def prompt_text(self) -> str:
        """The prompt as plain text, for fault matchers and the sim engine's seed."""
        if isinstance(self.prompt, tuple):
            return " ".join(map(str, self.prompt))
        if self.prompt is not None:
            return self.prompt
        if self.messages is None:  # a pooling request's input, as the client gave it
            return json.dumps(self.fields, sort_keys=True)
        return "\n".join(f"{m['role']}: {_content_text(m.get('content'))}" for m in self.messages)


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def invalid(field: str, why: str) -> Refusal:
    return Refusal(400, Code.INVALID_FIELD, f"{field}: {why}", field=field)


def required(body: Mapping[str, Any], field: str) -> Any:
    if body.get(field) is None:
        raise Refusal(400, Code.MISSING_FIELD, f"{field} is required", field=field)
    return body[field]


def whole(value: Any, field: str, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise invalid(field, f"must be an integer, not {type(value).__name__}")
    if not low <= value <= high:
        raise invalid(field, f"must be between {low} and {high}, not {value}")
    return value


def number(value: Any, field: str, low: float, high: float, *, low_open: bool = False) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise invalid(field, "must be a finite number")
    if value < low or value > high or (low_open and value == low):
        interval = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise invalid(field, f"must be in {interval}, not {value}")
    return float(value)


def text(value: Any, field: str, max_len: int = 256) -> str:
    # printable: an id goes into logs, headers and the admin listing (no NUL, no newline)
    if not isinstance(value, str) or not value or len(value) > max_len or not value.isprintable():
        raise invalid(field, f"must be a non-empty printable string of at most {max_len} characters")
    return value


def no_unknown(body: Mapping[str, Any], allowed: frozenset[str] | set[str], prefix: str) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        field = prefix + unknown[0]
        raise Refusal(400, Code.UNKNOWN_FIELD, f"unknown field {field!r}", field=field)


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
