"""The log's vocabulary (docs/design.md §3): one frozen, slotted dataclass per event.

Every event carries ``request_id``, ``seq`` (1, 2, 3… per request) and ``occurred_at`` (the
gateway's clock, read by the driver, never here); attempt-scoped ones ``attempt`` and
``lease_epoch``. Their JSON form, which the log stores and traces carry: :mod:`statemachine.jsonform`.
Those envelopes are in :mod:`statemachine.envelopes`, and the reasons events carry in
:mod:`statemachine.reasons`; both are imported from here where they are used.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from datetime import datetime
from typing import Any, ClassVar

from statemachine.deltas import ChoicePromptLogprobs, ChoicePrompts, ChoicePromptTokens, DeltaLogprobs, DeltaTokenIds
from statemachine.envelopes import AttemptScoped as AttemptScoped
from statemachine.envelopes import RequestScoped as RequestScoped
from statemachine.reasons import FINISH_REASONS as FINISH_REASONS
from statemachine.reasons import Deadline as Deadline
from statemachine.reasons import FailureKind as FailureKind
from statemachine.reasons import ReleaseReason as ReleaseReason

# --- request-scoped events -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RequestAccepted(RequestScoped):
    SCHEMA_VERSION: ClassVar[int] = 5
    ADDED: ClassVar[dict[int, tuple[str, ...]]] = {
        2: ("metadata",),
        3: ("background", "content_policy"),
        4: ("return_token_ids",),
        5: ("continuous_usage",),
    }
    model: str
    model_revision: str
    tenant: str
    endpoint: str  # "chat.completions" or "completions"
    stream: bool
    params_digest: str
    prompt_tokens: int
    n: int
    guided: bool
    tools: bool
    idempotency_key: str | None
    max_attempts: int  # the per-request retry budget in force when accepted
    seed: int | None
    gateway: str | None = None  # the gateway process that owns the request (for recovery)
    trace_id: str | None = None  # the OpenTelemetry trace of the request (32 hex digits), when traced
    logprobs: int | None = None  # log probabilities asked for: alternatives at each token (None: none)
    routing: dict[str, Any] | None = None  # how attempts are placed: RoutingConfig off its defaults (None: all)
    affinity_key: str | None = None  # the conversation's key for prefix affinity (a hash, never the text)
    metadata: dict[str, Any] | None = None  # the client's metadata, recorded for audit queries, not acted on
    # a background response (docs/design.md §15): no disconnect grace applies; whole, it generates
    # with no client attached from its accept on; readers attach, leave and attach again
    background: bool = False
    # the request's own content policy, where stricter than the gateway's (a response's
    # ``store: false``: ``digest``, or ``none`` under a gateway that keeps none); None: the gateway's
    content_policy: str | None = None
    return_token_ids: bool = False  # the answer carries its token ids and the prompt's (vLLM's extra)
    continuous_usage: bool = False  # the usage so far in every chunk (``stream_options``, as vLLM reads it)


@dataclass(frozen=True, slots=True)
class Decided(RequestScoped):
    """The policy's output, one event per action, logged with the policy's version."""

    action: str
    reason: str
    policy_version: str
    params: dict[str, Any]


@dataclass(frozen=True, slots=True)
class RetryBudgetDenied(RequestScoped):
    """The global retry budget refused a retry that the policy had decided."""

    scope: str


@dataclass(frozen=True, slots=True)
class NoReplicaAvailable(RequestScoped):
    """No healthy replica outside ``excluded`` could take a decided attempt."""

    excluded: tuple[str, ...]
    detail: str


@dataclass(frozen=True, slots=True)
class ClientDisconnected(RequestScoped):
    """The downstream socket closed before the request ended. Generation goes on for
    ``resume_grace_s`` (the gateway's setting when it happened; 0: cancelled at once)
    for a client to attach again (docs/design.md §12)."""

    resume_grace_s: float = 0.0


@dataclass(frozen=True, slots=True)
class ClientResumed(RequestScoped):
    """A client attached again to the live request within its grace, having deltas up
    to ``after`` (-1: none); what it is sent from here is delivered again."""

    after: int
    gateway: str


@dataclass(frozen=True, slots=True)
class ResumeGraceExpired(RequestScoped):
    """A timer: ``resume_grace_s`` passed with no client attached."""


@dataclass(frozen=True, slots=True)
class RetryWaitElapsed(RequestScoped):
    """A timer: the wait decided before retrying on ``replica_id`` (its ``Retry-After``) is over."""

    replica_id: str


@dataclass(frozen=True, slots=True)
class RequestCompleted(RequestScoped):
    """How the request ended well: ``finish_reason`` (and per choice) one of :data:`FINISH_REASONS`.

    ``usage`` holds the counts; ``usage_details`` what else the replica's usage said (its
    ``prompt_tokens_details``, ``completion_tokens_details``, as received); ``stop_reasons``
    per choice what stopped it, as vLLM says (a stop string, a token id, or ``None``)."""

    SCHEMA_VERSION: ClassVar[int] = 2
    ADDED: ClassVar[dict[int, tuple[str, ...]]] = {2: ("usage_details", "stop_reasons")}
    finish_reason: str
    usage: dict[str, int]
    finish_reasons: tuple[str, ...] = ()  # one per choice (empty in logs written before)
    usage_details: dict[str, Any] | None = None
    stop_reasons: tuple[str | int | None, ...] = ()


@dataclass(frozen=True, slots=True)
class RequestFailed(RequestScoped):
    code: str
    message: str
    partial_output: bool
    delivered_output_tokens: int
    retryable: bool


@dataclass(frozen=True, slots=True)
class RequestCancelled(RequestScoped):
    reason: str


@dataclass(frozen=True, slots=True)
class StreamResumed(RequestScoped):
    """A read of the ended request from the log (a stream, a poll showing output: docs/design.md §12,
    §15), bookkeeping after the end: deltas ``[from_index, to_index)`` sent by ``gateway``; ``tokens``,
    those of every delta the reader then had (the most any reader was shown counts)."""

    SCHEMA_VERSION: ClassVar[int] = 2
    ADDED: ClassVar[dict[int, tuple[str, ...]]] = {2: ("tokens",)}
    from_index: int
    to_index: int
    gateway: str
    tokens: int = 0


# --- attempt-scoped events -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AttemptStarted(AttemptScoped):
    SCHEMA_VERSION: ClassVar[int] = 2
    ADDED: ClassVar[dict[int, tuple[str, ...]]] = {2: ("model_revision",)}
    replica_id: str
    lease_expires_at: datetime
    acknowledges_cancel: bool = True  # the replica confirms a cancel (a worker); else only the lease
    # the replica aborts a request whose connection closed (vLLM's OpenAI server): before
    # any delivery, closing it fences the attempt (False in logs written before)
    aborts_on_close: bool = False
    model: str | None = None  # the model asked for, when a fallback's (None: the request's own)
    model_revision: str | None = None  # a fallback's, as its first attempt pinned it (docs/design.md §16)


@dataclass(frozen=True, slots=True)
class FirstTokenReceived(AttemptScoped):
    """The attempt produced its first chunk upstream; nothing is delivered yet."""


@dataclass(frozen=True, slots=True)
class FirstDeltaCommitted(AttemptScoped):
    """The commit point: durable before the first content byte reaches the client."""


@dataclass(frozen=True, slots=True)
class DeltasDelivered(AttemptScoped):
    """Deltas ``[from_index, to_index)`` of the attempt, written to the client.

    ``text``: the delivered text under the "full" content policy (``text_sha256``: its digest under
    "digest"; both ``None`` under "none"). ``deltas``: where each delta is, so a stream resumes at
    any (docs/design.md §12): per delta ``(choice, characters, tokens)``; no tokens: a choice's tool
    calls (their JSON); empty in older logs. With the text only ("full"), where asked: ``logprobs``
    per delta as the client got them (v4: a token sent under another name carries its text,
    :data:`TokenLogprob`); ``token_ids`` per delta and ``prompts``, what the replica said of the
    prompt of each choice whose first delta the batch holds (v3); ``prompt_logprobs``, the prompt's
    log probabilities said before each choice's first delta (v6, a whole answer's). ``fields`` (v2):
    per delta the field of the client's delta that carried its text (:data:`CONTENT`, a reasoning
    field, :data:`TOOL_CALLS`, :data:`NO_TEXT`, another the replica sent); empty when all are
    content. ``prompt_tokens`` (v5, any policy): where asked, the usage in every chunk's prompt count.
    """

    SCHEMA_VERSION: ClassVar[int] = 6
    ADDED: ClassVar[dict[int, tuple[str, ...]]] = {
        2: ("fields",),
        3: ("token_ids", "prompts"),
        5: ("prompt_tokens",),
        6: ("prompt_logprobs",),
    }
    WIDENED: ClassVar[dict[int, tuple[str, ...]]] = {4: ("logprobs",)}
    from_index: int
    to_index: int
    tokens: int
    text: str | None
    text_sha256: str | None
    deltas: tuple[tuple[int, int, int], ...] = ()
    logprobs: DeltaLogprobs | None = None
    fields: tuple[str, ...] = ()
    token_ids: DeltaTokenIds = ()
    prompts: ChoicePrompts = ()
    prompt_tokens: ChoicePromptTokens = ()
    prompt_logprobs: ChoicePromptLogprobs = ()


@dataclass(frozen=True, slots=True)
class DeltasProduced(AttemptScoped):
    """Deltas ``[from_index, to_index)`` produced while no client was attached (docs/design.md §12):
    recorded, not delivered. The fields are :class:`DeltasDelivered`'s (``logprobs`` since v3, wider in
    v4, ``prompt_tokens`` v5, ``prompt_logprobs`` v6); a client that receives them records them delivered."""

    SCHEMA_VERSION: ClassVar[int] = 6
    ADDED: ClassVar[dict[int, tuple[str, ...]]] = DeltasDelivered.ADDED | {3: ("logprobs", "token_ids", "prompts")}
    WIDENED: ClassVar[dict[int, tuple[str, ...]]] = {4: ("logprobs",)}
    from_index: int
    to_index: int
    tokens: int
    text: str | None
    text_sha256: str | None
    deltas: tuple[tuple[int, int, int], ...] = ()
    fields: tuple[str, ...] = ()
    logprobs: DeltaLogprobs | None = None
    token_ids: DeltaTokenIds = ()
    prompts: ChoicePrompts = ()
    prompt_tokens: ChoicePromptTokens = ()
    prompt_logprobs: ChoicePromptLogprobs = ()


@dataclass(frozen=True, slots=True)
class ToolCallEmitted(AttemptScoped):
    """A tool call of the attempt; ``idempotency_key`` = ``{request_id}:{tool_call_id}``.

    ``arguments`` holds the call's arguments under the "full" content policy, else "";
    ``arguments_sha256`` their digest under "digest", else ``None``. ``tool_call_id`` is
    the ledger's, made from the call's content; the client got the call under it, or,
    where the call's pieces were streamed to the client as the replica streamed them
    (before its content was whole), under the replica's id, ``client_tool_call_id``
    (version 2; ``None``: the ledger's).
    """

    SCHEMA_VERSION: ClassVar[int] = 2
    ADDED: ClassVar[dict[int, tuple[str, ...]]] = {2: ("client_tool_call_id",)}
    index: int
    tool_call_id: str
    name: str
    arguments: str
    idempotency_key: str
    arguments_sha256: str | None = None
    client_tool_call_id: str | None = None


@dataclass(frozen=True, slots=True)
class UpstreamFailed(AttemptScoped):
    kind: FailureKind
    detail: str
    deadline: Deadline | None = None  # set when a timer, not the replica, reported it
    upstream_status: int | None = None  # the upstream's HTTP status, where there was one
    upstream_code: str | None = None  # the upstream's own error code, passed on to clients
    upstream_param: str | None = None  # the client's parameter the upstream's refusal names
    retry_after_s: float | None = None  # the upstream's Retry-After, when it gave one


@dataclass(frozen=True, slots=True)
class CancelSent(AttemptScoped):
    """A cancel went to the replica; the attempt is presumed alive until acked or expired."""


@dataclass(frozen=True, slots=True)
class CancelAcked(AttemptScoped):
    """The replica confirmed its engine aborted the attempt."""

    generated_tokens: int | None


@dataclass(frozen=True, slots=True)
class LeaseExpired(AttemptScoped):
    """A timer: the attempt's lease lapsed unrenewed, so the replica has stopped it."""


@dataclass(frozen=True, slots=True)
class AttemptFenced(AttemptScoped):
    """Nothing more is forwarded from the attempt; it is presumed alive until released."""

    waiting_for: str


@dataclass(frozen=True, slots=True)
class AttemptReleased(AttemptScoped):
    because: ReleaseReason


Event = (
    RequestAccepted
    | AttemptStarted
    | FirstTokenReceived
    | FirstDeltaCommitted
    | DeltasDelivered
    | DeltasProduced
    | ToolCallEmitted
    | UpstreamFailed
    | CancelSent
    | CancelAcked
    | LeaseExpired
    | AttemptFenced
    | AttemptReleased
    | Decided
    | RetryBudgetDenied
    | NoReplicaAvailable
    | ClientDisconnected
    | ClientResumed
    | ResumeGraceExpired
    | RetryWaitElapsed
    | RequestCompleted
    | RequestFailed
    | RequestCancelled
    | StreamResumed
)

EVENT_TYPES: dict[str, type[Event]] = {cls.__name__: cls for cls in typing.get_args(Event)}
TERMINAL_EVENTS = (RequestCompleted, RequestFailed, RequestCancelled)  # the events that end a request: one a log


def is_attempt_scoped(cls: type[Event]) -> bool:
    return issubclass(cls, AttemptScoped)
