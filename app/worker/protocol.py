"""The worker protocol's vocabulary: error codes, the parsed requests and the checks of one field.

Everything the worker reads from the network (once ``json_body.py`` decoded it) is
parsed into these frozen dataclasses (a start request by ``start_request.py``), and every
refusal is a :class:`Refusal` with an HTTP status and a stable code from :class:`Code`; its
frames are in ``frame_encoders.py`` (``docs/worker-protocol.md``).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


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
    # the prompt's log probabilities, where the gateway's answer carries them (a whole one):
    # the alternatives at each prompt token (-1: every one); each choice's are said in a
    # ``prompt_logprobs`` frame before its first token frame. None: none are sent
    prompt_logprobs: int | None = None

    @property
    def choices(self) -> int:
        """The answer's choices: ``n`` for each prompt."""
        return self.sampling.n * max(len(self.batch), 1)

    @property
    def continuous_usage(self) -> bool:
        """The client asked for the usage in every chunk (its ``stream_options``, read as vLLM's
        server reads them: ``continuous_usage_stats`` with ``include_usage``)."""
        options = self.fields.get("stream_options")
        return isinstance(options, dict) and bool(
            options.get("include_usage") and options.get("continuous_usage_stats")
        )

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
