"""What the fold knows of a request: frozen values, built by :mod:`statemachine.state`.

:class:`RequestState` is the request as its log tells it so far, with one
:class:`AttemptState` per attempt. The vocabulary that the state and the policy share
lives here too: which decided actions are still pending (:class:`ActionName`), why a
decided start was refused (:class:`StartRefusal`), how the request ended
(:class:`Outcome`). Nothing here changes a value; :func:`statemachine.state.apply` does.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime

from statemachine.events import Deadline, FailureKind, ReleaseReason
from statemachine.phases import Phase
from statemachine.routing import DEFAULT_ROUTING, RoutingConfig

# Failures after which the attempt is surely not running: nothing to fence.
DEAD_KINDS = frozenset({FailureKind.REPLICA_EXITED, FailureKind.REJECTED, FailureKind.REQUEST_REFUSED})


def is_server_error(status: int | None, code: str | None) -> bool:
    """A replica's server error about the request itself: HTTP 500 (it failed on this
    input), or a worker's ``engine_error`` frame (its engine failed on this request).
    502, 503 and 504 speak of the path or the replica's state, not of the request."""
    return status == 500 or code == "engine_error"


class Outcome(enum.StrEnum):
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


class ActionName(enum.StrEnum):
    """The policy's actions, as ``Decided`` events name them."""

    START_ATTEMPT = "start_attempt"
    FENCE_ATTEMPT = "fence_attempt"
    CANCEL_ATTEMPT = "cancel_attempt"
    WAIT = "wait"
    WAIT_TO_RETRY = "wait_to_retry"
    FAIL_REQUEST = "fail_request"
    CANCEL_REQUEST = "cancel_request"


class StartRefusal(enum.StrEnum):
    """Why a decided attempt did not start."""

    NO_REPLICA = "no_replica"  # NoReplicaAvailable
    RETRY_BUDGET = "retry_budget"  # RetryBudgetDenied


class FenceWait(enum.StrEnum):
    """What a fenced attempt's release waits for (``AttemptFenced.waiting_for``)."""

    CANCEL_ACK_OR_LEASE_EXPIRY = "cancel_ack_or_lease_expiry"  # a replica that acknowledges cancels
    LEASE_EXPIRY = "lease_expiry"  # one that does not: only its lease proves it stopped
    # before any delivery, a replica that aborts on a closed connection: closing it is the
    # fence, assumed and never acknowledged (docs/design.md §7); the gateway alone publishes
    CONNECTION_CLOSE = "connection_close"


@dataclass(frozen=True)  # not slotted: evolve() copies it as one __dict__
class AttemptState:
    attempt: int
    lease_epoch: int
    replica_id: str
    started_at: datetime
    lease_expires_at: datetime
    model: str = ""  # the model it asked for: the request's, or a fallback's
    model_revision: str | None = None  # a fallback's revision, as its AttemptStarted pinned it
    acknowledges_cancel: bool = True  # the replica confirms a cancel (a worker); else only the lease
    aborts_on_close: bool = False  # the replica aborts when its connection closes (an OpenAI server)
    first_token_received: bool = False
    failure: FailureKind | None = None
    failure_deadline: Deadline | None = None
    failure_detail: str | None = None
    upstream_status: int | None = None
    upstream_code: str | None = None
    upstream_param: str | None = None
    retry_after_s: float | None = None
    failure_answered: bool = False  # a decision was recorded after the last failure
    fenced: bool = False
    waiting_for: str | None = None  # what its fence waits for, as AttemptFenced recorded it
    cancel_sent: bool = False
    cancel_acked: bool = False
    lease_expired: bool = False
    released: ReleaseReason | None = None
    completed: bool = False

    @property
    def dead(self) -> bool:
        return self.failure in DEAD_KINDS

    @property
    def live(self) -> bool:
        """Presumed able to publish: not known dead, not released, not finished."""
        return not self.dead and self.released is None and not self.completed

    @property
    def server_error(self) -> bool:
        """It failed with a server error about the request (:func:`is_server_error`)."""
        return self.failure is not None and is_server_error(self.upstream_status, self.upstream_code)

    def fence_wait(self, *, delivered: bool) -> FenceWait:
        """What fencing this attempt waits for: while nothing was delivered, the closed
        connection of a replica that aborts on it; else its cancel ack or its lease."""
        if self.aborts_on_close and not delivered:
            return FenceWait.CONNECTION_CLOSE
        return FenceWait.CANCEL_ACK_OR_LEASE_EXPIRY if self.acknowledges_cancel else FenceWait.LEASE_EXPIRY

    @property
    def ended(self) -> str | None:
        """How the attempt ended, in the log's words, or ``None`` while it is live."""
        if self.completed:
            return "completed"
        if self.released is not None:
            return self.released.value
        if self.dead:
            assert self.failure is not None
            return self.failure.value
        return None


@dataclass(frozen=True, slots=True)
class EmittedToolCall:
    """A tool call an attempt asked for, as ``ToolCallEmitted`` recorded it."""

    attempt: int
    index: int
    tool_call_id: str
    name: str
    idempotency_key: str


@dataclass(frozen=True)  # not slotted: evolve() copies it as one __dict__
class RequestState:
    request_id: str
    phase: Phase = Phase.NEW
    seq: int = 0
    model: str = ""
    model_revision: str = ""  # the revision its RequestAccepted recorded: its attempts stay on it (§16)
    tenant: str = ""
    prompt_tokens: int = 0
    n: int = 1
    guided: bool = False
    tools: bool = False
    max_attempts: int = 0
    routing: RoutingConfig = DEFAULT_ROUTING
    affinity_key: str | None = None
    attempts: tuple[AttemptState, ...] = ()
    first_delta_attempt: int | None = None
    delivered_deltas: int = 0  # delivered live: where the log's produced tail starts
    delivered_output_tokens: int = 0  # the most any reader was shown (StreamResumed's tokens too)
    read_deltas: int = 0  # the most deltas a reader of the ended request was shown (StreamResumed)
    tool_calls: tuple[EmittedToolCall, ...] = ()
    client_gone: bool = False  # no client attached since ClientDisconnected (until ClientResumed)
    background: bool = False  # a background response: no grace runs out for want of a client (§15)
    disconnects: int = 0  # ClientDisconnected events so far (a client may come back and leave again)
    resume_grace_s: float = 0.0  # how long a client that left may attach again (its ClientDisconnected)
    resume_grace_expired: bool = False  # the grace ran out with no client attached
    produced_deltas: int = 0  # deltas of the current attempt in the log, delivered or only produced
    start_refused: StartRefusal | None = None
    waited_for: str | None = None  # the replica a decided retry wait was for, once it is over
    pending: frozenset[ActionName] = frozenset()  # decided actions not yet seen carried out
    outcome: Outcome | None = None
    error_code: str | None = None
    finish_reason: str | None = None
    last_occurred_at: datetime | None = None  # the log's times never go back

    @property
    def awaits_a_client(self) -> bool:
        """A client may attach to it now: a background response always, else one that left
        within a grace still running."""
        return self.background or (self.resume_grace_s > 0 and not self.resume_grace_expired)

    @property
    def first_delta_sent(self) -> bool:
        return self.first_delta_attempt is not None

    @property
    def current_attempt(self) -> AttemptState | None:
        return self.attempts[-1] if self.attempts else None

    @property
    def retry_budget_left(self) -> int:
        return max(self.max_attempts - len(self.attempts), 0)

    @property
    def replicas_tried(self) -> tuple[str, ...]:
        return tuple(attempt.replica_id for attempt in self.attempts)

    @property
    def answered_by(self) -> str:
        """The model whose output the client gets: the delivering attempt's (a fallback's,
        if one answered), else the current one's, else the request's."""
        number = self.first_delta_attempt
        attempt = self.attempt(number) if number is not None else self.current_attempt
        return attempt.model if attempt is not None and attempt.model else self.model

    def attempts_on(self, model: str) -> int:
        return sum(attempt.model == model for attempt in self.attempts)

    def revision_of(self, model: str) -> str | None:
        """The revision every attempt of ``model`` stays on (docs/design.md §16): the
        request's own model's from its ``RequestAccepted``, a fallback's from its first
        attempt; ``None`` until one is known (the configured revision then applies)."""
        if model == self.model:
            return self.model_revision if self.model_revision not in ("", "unknown") else None
        return next((a.model_revision for a in self.attempts if a.model == model and a.model_revision), None)

    def attempt(self, number: int) -> AttemptState | None:
        if 1 <= number <= len(self.attempts):
            return self.attempts[number - 1]
        return None
