"""Legal event sequences, built the way the driver would build them: for the store tests and ``ops/seed.py``.

A :class:`Trace` appends one event at a time, folding as it goes (so an illegal
sequence fails here, not in the store), and records the policy's own decisions
(``decide`` → ``Decided``), so the traces also replay without divergence.
The scenarios at the bottom are the shapes the audit queries ask about.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from statemachine.actions import Action, FailRequest, FenceAttempt
from statemachine.deltas import CONTENT
from statemachine.events import (
    AttemptFenced,
    AttemptReleased,
    AttemptStarted,
    CancelAcked,
    CancelSent,
    ClientDisconnected,
    ClientResumed,
    Decided,
    DeltasDelivered,
    DeltasProduced,
    Event,
    FailureKind,
    FirstDeltaCommitted,
    FirstTokenReceived,
    LeaseExpired,
    ReleaseReason,
    RequestAccepted,
    RequestCancelled,
    RequestCompleted,
    RequestFailed,
    ResumeGraceExpired,
    ToolCallEmitted,
    UpstreamFailed,
)
from statemachine.policy import decide, decided_fields
from statemachine.policy_config import PolicyConfig
from statemachine.request_state import RequestState
from statemachine.routing import PoolSnapshot, ReplicaView
from statemachine.state import advance

T0 = datetime(2026, 11, 30, 17, 0, tzinfo=UTC)


class Trace:
    """One request's events; each method appends the event it names."""

    def __init__(
        self,
        request_id: str,
        *,
        at: datetime = T0,
        model: str = "tiny-llm",
        tenant: str = "acme",
        gateway: str | None = "gw-1",
        trace_id: str | None = None,
        metadata: dict[str, str] | None = None,
        endpoint: str = "chat.completions",
    ):
        self.request_id = request_id
        self.clock = at
        self.events: list[Event] = []
        self.state = RequestState(request_id=request_id)
        self.actions: list[Action] = []
        self._accept(model, tenant, gateway, trace_id, metadata, endpoint)

    # --- the envelope ------------------------------------------------------------------

    def add(self, cls: type[Event], after_ms: float = 1.0, **fields: Any) -> Event:
        self.clock += timedelta(milliseconds=after_ms)
        self.state, event = advance(self.state, cls, self.clock, **fields)  # raises on an illegal sequence
        self.events.append(event)
        return event

    def _scope(self) -> dict[str, int]:
        current = self.state.current_attempt
        assert current is not None, "no attempt started"
        return {"attempt": current.attempt, "lease_epoch": current.lease_epoch}

    # --- steps -------------------------------------------------------------------------

    def _accept(
        self,
        model: str,
        tenant: str,
        gateway: str | None,
        trace_id: str | None,
        metadata: dict[str, str] | None,
        endpoint: str,
    ) -> None:
        self.add(
            RequestAccepted,
            after_ms=0,
            model=model,
            model_revision="r2026.11",
            tenant=tenant,
            endpoint=endpoint,
            stream=True,
            params_digest="sha256:00",
            prompt_tokens=24,
            n=1,
            guided=False,
            tools=False,
            idempotency_key=None,
            max_attempts=2,
            seed=7,
            gateway=gateway,
            trace_id=trace_id,
            metadata=metadata,
        )

    def decide(self, after_ms: float = 0.2, pool: PoolSnapshot | None = None) -> list[Action]:
        """Record what the policy decides now, as ``Decided`` events."""
        actions = decide(self.state, PolicyConfig(), pool)
        for action in actions:
            self.add(Decided, after_ms, **decided_fields(action))
        self.actions = actions
        return actions

    def start(self, replica: str, after_ms: float = 1.0) -> Trace:
        self.decide(pool=PoolSnapshot((ReplicaView(replica),)))  # the policy places it there
        previous = self.state.current_attempt
        self.add(
            AttemptStarted,
            after_ms,
            attempt=len(self.state.attempts) + 1,
            lease_epoch=(previous.lease_epoch if previous else 0) + 1,
            replica_id=replica,
            lease_expires_at=self.clock + timedelta(seconds=5),
        )
        return self

    def first_token(self, after_ms: float = 20.0) -> Trace:
        self.add(FirstTokenReceived, after_ms, **self._scope())
        return self

    def first_delta(self, after_ms: float = 1.0) -> Trace:
        self.add(FirstDeltaCommitted, after_ms, **self._scope())
        return self

    def deliver(self, text: str, tokens: int = 1, after_ms: float = 5.0, key: str = CONTENT) -> Trace:
        """One delta, its text under ``key`` of the client's delta (content, reasoning …)."""
        shaped = {} if key == CONTENT else {"deltas": ((0, len(text), tokens),), "fields": (key,)}
        return self._one_delta(DeltasDelivered, self.state.delivered_deltas, text, tokens, after_ms, **shaped)

    def tool_call(self, tool_call_id: str, name: str, arguments: str, after_ms: float = 5.0) -> Trace:
        self.add(
            ToolCallEmitted,
            after_ms,
            **self._scope(),
            index=len(self.state.tool_calls),
            tool_call_id=tool_call_id,
            name=name,
            arguments=arguments,
            idempotency_key=f"{self.request_id}:{tool_call_id}",
        )
        return self

    def upstream_failed(self, kind: FailureKind, detail: str = "", after_ms: float = 10.0) -> Trace:
        self.add(UpstreamFailed, after_ms, **self._scope(), kind=kind, detail=detail or kind.value)
        return self

    def fence(self, after_ms: float = 0.5) -> Trace:
        """Decide (the policy fences), fence and send the cancel."""
        self.decide()
        self.add(AttemptFenced, after_ms, **self._scope(), waiting_for="cancel_ack_or_lease_expiry")
        self.add(CancelSent, 0.2, **self._scope())
        return self

    def cancel_acked(self, attempt: int, after_ms: float = 30.0, *, generated_tokens: int | None = 3) -> Trace:
        epoch = self._epoch(attempt)
        self.add(CancelAcked, after_ms, attempt=attempt, lease_epoch=epoch, generated_tokens=generated_tokens)
        return self

    def lease_expired(self, attempt: int, after_ms: float = 5000.0) -> Trace:
        self.add(LeaseExpired, after_ms, attempt=attempt, lease_epoch=self._epoch(attempt))
        return self

    def released(self, attempt: int, because: ReleaseReason, after_ms: float = 0.2) -> Trace:
        self.add(AttemptReleased, after_ms, attempt=attempt, lease_epoch=self._epoch(attempt), because=because)
        return self

    def completed(self, after_ms: float = 5.0, **details: Any) -> Trace:
        """The completion; ``details``: its ``usage_details`` and ``stop_reasons``, if any."""
        tokens = self.state.delivered_output_tokens
        usage = {"prompt_tokens": 24, "completion_tokens": tokens, "total_tokens": 24 + tokens}
        self.add(RequestCompleted, after_ms, finish_reason="stop", usage=usage, **details)
        return self

    def failed_as_decided(self, after_ms: float = 0.5) -> Trace:
        """Decide, carry out a fence if decided, and fail the request as decided."""
        actions = self.decide()
        for fence in (action for action in actions if isinstance(action, FenceAttempt)):
            self.add(AttemptFenced, after_ms, **self._scope(), waiting_for=fence.wait_for)
        (failure,) = (action for action in actions if isinstance(action, FailRequest))
        self.add(
            RequestFailed,
            after_ms,
            code=failure.code,
            message=failure.message,
            partial_output=failure.partial_output,
            delivered_output_tokens=failure.delivered_output_tokens,
            retryable=failure.retryable,
        )
        return self

    def client_disconnected(self, after_ms: float = 3.0) -> Trace:
        self.add(ClientDisconnected, after_ms)
        return self._cancelled_for_the_client()

    def client_left(self, resume_grace_s: float, after_ms: float = 3.0) -> Trace:
        """The client left; generation goes on for the grace (docs/design.md §12)."""
        self.add(ClientDisconnected, after_ms, resume_grace_s=resume_grace_s)
        return self

    def produce(self, text: str, tokens: int = 1, after_ms: float = 5.0) -> Trace:
        return self._one_delta(
            DeltasProduced, self.state.produced_deltas, text, tokens, after_ms, deltas=((0, len(text), tokens),)
        )

    def _one_delta(
        self,
        cls: type[DeltasDelivered | DeltasProduced],
        start: int,
        text: str,
        tokens: int,
        after_ms: float,
        **extra: Any,
    ) -> Trace:
        self.add(
            cls,
            after_ms,
            **self._scope(),
            from_index=start,
            to_index=start + 1,
            tokens=tokens,
            text=text,
            text_sha256=None,
            **extra,
        )
        return self

    def client_back(self, after: int, after_ms: float = 50.0) -> Trace:
        self.add(ClientResumed, after_ms, after=after, gateway="gw-1")
        return self

    def grace_expired(self, after_ms: float = 10000.0) -> Trace:
        self.add(ResumeGraceExpired, after_ms)
        return self._cancelled_for_the_client()

    def _cancelled_for_the_client(self) -> Trace:
        self.decide()  # cancel the attempt, cancel the request
        self.add(CancelSent, 0.2, **self._scope())
        self.add(RequestCancelled, 0.2, reason="client_gone")
        return self

    def _epoch(self, attempt: int) -> int:
        found = self.state.attempt(attempt)
        assert found is not None
        return found.lease_epoch


# --- scenarios --------------------------------------------------------------------------


def completed(
    request_id: str,
    replica: str = "w1",
    *,
    at: datetime = T0,
    model: str = "tiny-llm",
    tenant: str = "acme",
    texts: tuple[str, ...] = ("Hel", "lo", "!"),
    ttft_ms: float = 20.0,
    metadata: dict[str, str] | None = None,
) -> Trace:
    trace = Trace(request_id, at=at, model=model, tenant=tenant, metadata=metadata)
    trace = trace.start(replica).first_token(ttft_ms).first_delta()
    for text in texts:
        trace.deliver(text)
    return trace.completed()


def retried_before_first_delta(request_id: str, *, at: datetime = T0) -> Trace:
    """w1 exits during prefill; the retry on w2 answers."""
    trace = Trace(request_id, at=at).start("w1").upstream_failed(FailureKind.REPLICA_EXITED, "connection reset")
    trace.start("w2").first_token(40).first_delta().deliver("Hi").deliver(" there")
    return trace.completed()


def fenced_then_retried(request_id: str, *, at: datetime = T0, trace_id: str | None = None) -> Trace:
    """w2 stalls in prefill: fenced, its lease expires, then the retry on w3 answers."""
    trace = Trace(request_id, at=at, trace_id=trace_id).start("w2")
    trace.upstream_failed(FailureKind.LIVENESS_UNCERTAIN, "read timeout")
    trace.fence().lease_expired(1, after_ms=4200).released(1, ReleaseReason.LEASE_EXPIRED)
    trace.start("w3").first_token(30).first_delta().deliver("Ok")
    return trace.completed()


def interrupted_in_decode(request_id: str, replica: str = "w1", *, at: datetime = T0) -> Trace:
    """The replica dies after two deltas were delivered: upstream_decode_interrupted."""
    trace = Trace(request_id, at=at).start(replica).first_token().first_delta()
    trace.deliver("The answer", tokens=2).deliver(" is", tokens=1)
    trace.upstream_failed(FailureKind.REPLICA_EXITED, "worker exited")
    return trace.failed_as_decided()


def stalled_in_decode(request_id: str, replica: str = "w3", *, at: datetime = T0) -> Trace:
    """A stall after a delta: the stream fails at once, the fence completes afterwards."""
    trace = Trace(request_id, at=at).start(replica).first_token().first_delta().deliver("Once")
    trace.upstream_failed(FailureKind.LIVENESS_UNCERTAIN, "no heartbeat for 2 s")
    trace.failed_as_decided()
    trace.add(CancelSent, 0.3, attempt=1, lease_epoch=1)
    return trace.cancel_acked(1, after_ms=120).released(1, ReleaseReason.CANCEL_ACKED)


def cancelled_by_client(request_id: str, *, at: datetime = T0) -> Trace:
    trace = Trace(request_id, at=at).start("w2").first_token().first_delta().deliver("Wait")
    trace.client_disconnected()
    return trace.cancel_acked(1, after_ms=15).released(1, ReleaseReason.CANCEL_ACKED)


def resumed_within_grace(request_id: str, *, at: datetime = T0) -> Trace:
    """The client leaves after a delta; two are produced with no client attached; it
    comes back, receives them and the rest."""
    trace = Trace(request_id, at=at).start("w1").first_token().first_delta().deliver("One")
    trace.client_left(10.0).produce(" two").produce(" three").client_back(after=0)
    return trace.deliver(" two").deliver(" three").deliver(" four").completed()


def left_for_good(request_id: str, *, at: datetime = T0) -> Trace:
    """The client leaves and never comes back: the grace runs out, then the cancel."""
    trace = Trace(request_id, at=at).start("w2").first_token().first_delta().deliver("Only")
    trace.client_left(10.0).produce(" this").grace_expired()
    return trace.cancel_acked(1, after_ms=15).released(1, ReleaseReason.CANCEL_ACKED)


def with_tool_call(request_id: str, *, at: datetime = T0) -> Trace:
    trace = Trace(request_id, at=at).start("w1").first_token().first_delta()
    trace.tool_call("call_1", "get_weather", '{"city": "Almaty"}')
    return trace.completed()


def in_flight(request_id: str, *, at: datetime = T0, gateway: str = "gw-1") -> Trace:
    """Still decoding: no terminal event yet."""
    return Trace(request_id, at=at, gateway=gateway).start("w1").first_token().first_delta().deliver("Still")


def pooled(
    request_id: str, endpoint: str, *, at: datetime = T0, prompt_tokens: int = 6, retried: bool = False
) -> Trace:
    """A pooling request (docs/design.md §17): no delta, its answer whole at the completion;
    ``retried``: its first replica (w4) exits before the answer, the second (w5) answers."""
    trace = Trace(request_id, at=at, model="tiny-embed", endpoint=endpoint).start("w4")
    if retried:
        trace.upstream_failed(FailureKind.REPLICA_EXITED, "connection reset").start("w5")
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 0, "total_tokens": prompt_tokens}
    trace.add(RequestCompleted, 8.0, finish_reason="stop", usage=usage)
    return trace
