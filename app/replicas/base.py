"""What the driver needs from a replica, whatever kind it is.

Two kinds implement :class:`ReplicaClient`: a ``phasegate worker`` (leases, cancel
acknowledgements, heartbeats) and any OpenAI-compatible server such as ``vllm
serve`` (no acknowledgement: a cancel is only a closed connection, which such a
server aborts on; so before any delivery the closed connection fences the attempt,
and after one the fence waits for the lease to expire, docs/design.md §7).

A started attempt is an async iterator of frames. Everything that goes wrong is an
:class:`UpstreamFailure` carrying the failure kind of docs/design.md §4, so the driver
records what it observed without knowing which client observed it.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from app.contract.logprobs import TokenLogprob
from statemachine.deltas import CONTENT, Prompt, PromptLogprobs
from statemachine.events import FailureKind


class ProbeAnswer(enum.Enum):
    """What one health probe of a replica came back with."""

    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"  # it answered, and not well; or nothing listens there
    SILENT = "silent"  # no answer in time: a silent replica, or one too busy to answer
    INCOMPATIBLE = "incompatible"  # healthy, in a protocol this gateway does not speak: not used


# Frames are plain slotted classes (not frozen: built once per token on the hot path).


@dataclass(slots=True)
class Heartbeat:
    """The replica is alive and has produced nothing yet: ``phase`` queued or prefill."""

    phase: str
    queue_position: int | None = None


@dataclass(slots=True)
class Token:
    """Text of one choice, as the replica streamed it: in the client's delta under ``key``
    (content; reasoning, under the name the replica gave it; any other text field)."""

    choice: int
    index: int
    text: str
    token_ids: Sequence[int] = ()  # an OpenAI upstream names none: one token a chunk
    logprobs: tuple[TokenLogprob, ...] | None = None  # asked for: one per token (app/contract/logprobs.py)
    key: str = CONTENT
    # engine tokens in it, where not one a chunk or its token ids: 0 for the rest of a chunk
    # whose token another key took (a reasoning parser splits one token's text in two)
    tokens: int | None = None
    # what the replica said of the choice's prompt before this, its first text (return_token_ids,
    # return_prompt_text, a completion's echo); None for any later token
    prompt: Prompt | None = None
    # the prompt's tokens as the replica counted them, said with a choice's first text where
    # the attempt asked (``AttemptRequest.continuous_usage``); None for any later token
    prompt_tokens: int | None = None
    # the prompt's log probabilities, said before a choice's first text where the attempt asked
    # (``AttemptRequest.prompt_logprobs``); None for any later token
    prompt_logprobs: PromptLogprobs | None = None


def tool_call_piece_problem(calls: Any) -> str | None:
    """Why ``calls`` is not a chat delta's ``tool_calls`` (a list of objects, each naming the
    call it adds to by ``index``, its id, name and arguments strings), or None."""
    if not isinstance(calls, list) or not calls:
        return f"tool_calls that are not a non-empty list: {calls!r:.200}"
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(call, dict)
            or type(call.get("index", 0)) is not int
            or not isinstance(call.get("id") or "", str)
            or not isinstance(function or {}, dict)
            or any(part is not None and type(part) is not str for part in (function or {}).values())
        ):
            return f"a malformed tool call piece: {call!r:.200}"
    return None


@dataclass(slots=True)
class ToolCallFrame:
    """A choice's whole tool call, for the tool ledger. ``streamed``: its pieces already
    went to the client as the replica streamed them (tokens under ``tool_calls``,
    with the replica's id); otherwise the client gets it whole, under the gateway's id."""

    choice: int
    index: int
    id: str  # the replica's id for it
    name: str
    arguments: str
    streamed: bool = False


@dataclass(frozen=True, slots=True)
class PooledAnswer:
    """A pooling request's whole answer, as the replica gave it (docs/design.md §17): its
    body (JSON, or vLLM's bytes for ``encoding_format: bytes``), its media type, and the
    headers that belong to it (vLLM's ``metadata`` of a bytes answer)."""

    body: bytes
    media_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class Done:
    finish_reason: str
    finish_reasons: list[str]  # one per choice
    usage: dict[str, int] = field(default_factory=dict)
    stop_reasons: list[str | int | None] = field(default_factory=list)  # per choice, as the replica said
    usage_details: dict[str, Any] | None = None  # the usage's other fields, as received
    answer: PooledAnswer | None = None  # a pooling request's: the whole answer, no tokens before it


Frame = Heartbeat | Token | ToolCallFrame | Done


def usage_of(given: dict[str, Any]) -> tuple[dict[str, int], dict[str, Any] | None]:
    """A usage's counts (integers the log can hold: bigint) and the rest of it, as received
    (``prompt_tokens_details``, ``completion_tokens_details`` …; ``None`` when there is none)."""
    counts = {k: v for k, v in given.items() if type(v) is int and 0 <= v < 2**63}
    details = {k: v for k, v in given.items() if k not in counts and v is not None}
    return counts, details or None


class UpstreamFailure(Exception):
    """Anything that stopped an attempt, as the kind the policy reasons about.

    Each client raises its own subclasses (``worker_errors.py``) or this class itself.
    """

    def __init__(
        self,
        kind: FailureKind,
        detail: str,
        *,
        status: int | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(detail)
        self.kind = kind
        self.detail = detail
        self.status = status
        self.code = code
        self.retry_after_s = retry_after_s
        self.param = param  # the client's parameter a refusal names, where it names one


@dataclass(frozen=True, slots=True)
class AttemptRequest:
    """What one attempt asks of a replica."""

    request_id: str
    attempt: int
    lease_epoch: int
    lease_ttl_s: float
    endpoint: str  # "chat.completions", "completions", or a pooling route's path ("/v1/embeddings" …)
    model: str
    messages: tuple[dict[str, Any], ...] | None
    prompt: Any  # a completion's prompt as the client gave it: a string, token ids, a batch
    sampling: dict[str, Any]  # what a worker takes (OpenAI names, only those given)
    # the client's own fields, for an OpenAI-compatible replica: all of them but phasegate's
    # (app/contract/request_fields.py), as the client sent them
    passed: dict[str, Any] = field(default_factory=dict)
    choices: int = 1  # the answer's choices (n for each prompt of a batch)
    # the client asked for the usage in every chunk: the replica says the prompt's tokens
    # before each choice's first text (an ``openai`` replica: in its chunks' usage)
    continuous_usage: bool = False
    # the client asked a whole answer with the prompt's log probabilities (this many
    # alternatives at each prompt token): the replica says them before each choice's first
    # delta (an ``openai`` replica is asked unstreamed: vLLM streams none)
    prompt_logprobs: int | None = None


class AttemptStream(Protocol):
    # True: the answer is asked whole, so its first frame comes with its last, and the
    # first-token deadline of a replica without heartbeats is first_token_hard_s
    # (app/driver/attempt.py)
    unstreamed: bool

    def frames(self) -> AsyncIterator[Frame]: ...

    async def close(self) -> None: ...


# One attempt's renewal in a round: its request, this renewal's number for the attempt (1,
# 2, …) and the last one whose answer came (0: the start's) (app/replicas/renewer.py)
Renewal = tuple[AttemptRequest, int, int]


class ReplicaClient(Protocol):
    replica_id: str
    kind: str
    acknowledges_cancel: bool  # False: a fence waits for the lease to expire
    aborts_on_close: bool  # True: before any delivery, closing the stream is the fence (no proof)
    sends_heartbeats: bool  # False: silence before the first token is not a stall
    reported_load: int | None  # running + queued, as its last health answer said (None: it never says)
    incompatible: str | None  # why its last probe was INCOMPATIBLE, for the operator (None: it was not)

    async def start(self, request: AttemptRequest) -> AttemptStream:
        """Open the attempt; raises :class:`UpstreamFailure` if it cannot start."""
        ...

    async def renew_all(self, renewals: Sequence[Renewal]) -> list[bool]:
        """Extend these attempts' leases in one round: per attempt, ``False`` when the
        replica refused (stale epoch, unknown attempt); raises :class:`UpstreamFailure`
        when the round went unanswered (the leases may still run)."""
        ...

    async def cancel(self, request_id: str, attempt: int, lease_epoch: int) -> int | None:
        """Cancel; the generated token count once the engine confirmed the abort, or
        ``None`` when no acknowledgement came (or this kind gives none)."""
        ...

    async def health(self) -> ProbeAnswer:
        """One health probe; :attr:`ProbeAnswer.SILENT` when no answer came in time."""
        ...

    async def model_cards(self) -> dict[str, dict[str, Any]]:
        """What the replica says of the models it serves, by name (vLLM's ``/v1/models``
        entries: ``max_model_len``, ``root``, ``permission`` …); empty when it says nothing
        or does not answer."""
        ...

    async def utility(self, path: str, body: dict[str, Any] | None) -> tuple[int, Any]:
        """One of vLLM's utility routes (``tokenize``, ``detokenize``: POSTed ``body``;
        ``version``: a GET, ``body`` None) on the replica: its status and JSON answer.
        Raises ``httpx.HTTPError`` when no answer came, ``ValueError`` for one not JSON."""
        ...

    async def close(self) -> None: ...
