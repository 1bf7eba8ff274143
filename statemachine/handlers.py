"""The fold's handlers: one per event type, each checks its event against the request's
invariants (listed in :mod:`statemachine.state`) and returns the fields of the state it changes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from statemachine.attempts import (
    Changes,
    illegal,
    live_current,
    replaced_last,
    scoped,
    unreleased,
    with_attempt,
    with_current,
)
from statemachine.batches import batch_problem
from statemachine.events import (
    FINISH_REASONS,
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
    FirstDeltaCommitted,
    FirstTokenReceived,
    LeaseExpired,
    NoReplicaAvailable,
    ReleaseReason,
    RequestAccepted,
    RequestCancelled,
    RequestCompleted,
    RequestFailed,
    ResumeGraceExpired,
    RetryBudgetDenied,
    RetryWaitElapsed,
    StreamResumed,
    ToolCallEmitted,
    UpstreamFailed,
)
from statemachine.evolve import evolve as _evolve
from statemachine.phases import Phase
from statemachine.request_state import (
    ActionName,
    AttemptState,
    EmittedToolCall,
    FenceWait,
    Outcome,
    RequestState,
    StartRefusal,
)
from statemachine.routing import RoutingConfig


def _on_accepted(state: RequestState, event: RequestAccepted) -> Changes:
    if event.max_attempts < 1 or event.n < 1 or event.prompt_tokens < 0:
        raise illegal(state, event, "max_attempts and n must be at least 1")
    if event.content_policy not in (None, "none", "digest", "full"):
        raise illegal(state, event, f"unknown content policy {event.content_policy!r}")
    try:
        routing = RoutingConfig() if event.routing is None else RoutingConfig.from_params(event.routing)
    except (TypeError, ValueError) as exc:
        raise illegal(state, event, f"routing: {exc}") from None
    return {
        "routing": routing,
        "affinity_key": event.affinity_key,
        "model": event.model,
        "model_revision": event.model_revision,
        "tenant": event.tenant,
        "prompt_tokens": event.prompt_tokens,
        "n": event.n,
        "guided": event.guided,
        "tools": event.tools,
        "max_attempts": event.max_attempts,
        "background": event.background,
        "client_gone": event.background and not event.stream,  # a streamed one's POST reads it
    }


def _on_decided(state: RequestState, event: Decided) -> Changes:
    changes: Changes = {}
    try:
        action = ActionName(event.action)
    except ValueError:
        raise illegal(state, event, f"unknown action {event.action!r}") from None
    if action is not ActionName.WAIT:
        changes["pending"] = state.pending | {action}
    current = state.current_attempt
    if current is not None and current.failure is not None and not current.failure_answered:
        changes["attempts"] = replaced_last(state.attempts, failure_answered=True)
    return changes


def _on_attempt_started(state: RequestState, event: AttemptStarted) -> Changes:
    if event.attempt != len(state.attempts) + 1:
        raise illegal(state, event, f"attempt {event.attempt} is not attempt {len(state.attempts) + 1}")
    previous = state.current_attempt
    if previous is not None:
        if previous.live:
            raise illegal(state, event, f"attempt {previous.attempt} is still live")
        if event.lease_epoch <= previous.lease_epoch:
            raise illegal(state, event, "lease epoch does not increase")
    if event.lease_epoch < 0:
        raise illegal(state, event, f"negative lease epoch {event.lease_epoch}")
    attempt = AttemptState(
        attempt=event.attempt,
        lease_epoch=event.lease_epoch,
        replica_id=event.replica_id,
        started_at=event.occurred_at,
        lease_expires_at=event.lease_expires_at,
        acknowledges_cancel=event.acknowledges_cancel,
        aborts_on_close=event.aborts_on_close,
        model=event.model or state.model,
        model_revision=event.model_revision,
    )
    return {
        "attempts": (*state.attempts, attempt),
        "pending": state.pending - {ActionName.START_ATTEMPT},
        "start_refused": None,
        "waited_for": None,
        "produced_deltas": 0,  # a retry's deltas are numbered from 0 again (nothing was delivered)
    }


def _on_start_refused(state: RequestState, event: NoReplicaAvailable | RetryBudgetDenied) -> Changes:
    if ActionName.START_ATTEMPT not in state.pending:
        raise illegal(state, event, "no attempt start was decided")
    refused = StartRefusal.NO_REPLICA if isinstance(event, NoReplicaAvailable) else StartRefusal.RETRY_BUDGET
    return {"pending": state.pending - {ActionName.START_ATTEMPT}, "start_refused": refused}


def _on_first_token(state: RequestState, event: FirstTokenReceived) -> Changes:
    attempt = live_current(state, event)
    return with_current(state, _evolve(attempt, {"first_token_received": True}))


def _on_first_delta(state: RequestState, event: FirstDeltaCommitted) -> Changes:
    live_current(state, event)
    return {"first_delta_attempt": event.attempt}


def _on_deltas(state: RequestState, event: DeltasDelivered) -> Changes:
    if event.attempt != state.first_delta_attempt:
        raise illegal(state, event, f"attempt {event.attempt} did not commit the first delta")
    live_current(state, event)
    problem = batch_problem(event, follows=state.delivered_deltas)
    if problem is not None:
        raise illegal(state, event, problem)
    return {
        "delivered_deltas": event.to_index,
        "delivered_output_tokens": state.delivered_output_tokens + event.tokens,
        "produced_deltas": max(state.produced_deltas, event.to_index),
    }


def _on_deltas_produced(state: RequestState, event: DeltasProduced) -> Changes:
    if not state.client_gone:
        raise illegal(state, event, "output is recorded as only produced while no client is attached")
    live_current(state, event)
    problem = batch_problem(event, follows=state.produced_deltas)
    if problem is not None:
        raise illegal(state, event, problem)
    return {"produced_deltas": event.to_index}


def _on_tool_call(state: RequestState, event: ToolCallEmitted) -> Changes:
    live_current(state, event)
    if event.idempotency_key != f"{state.request_id}:{event.tool_call_id}":
        raise illegal(state, event, "idempotency key is not {request_id}:{tool_call_id}")
    call = EmittedToolCall(event.attempt, event.index, event.tool_call_id, event.name, event.idempotency_key)
    return {"tool_calls": (*state.tool_calls, call)}


def _on_upstream_failed(state: RequestState, event: UpstreamFailed) -> Changes:
    attempt = scoped(state, event)
    if attempt is not state.current_attempt or attempt.released is not None or attempt.completed:
        raise illegal(state, event, f"attempt {event.attempt} is not the running attempt")
    failed = {
        "failure": event.kind,
        "failure_deadline": event.deadline,
        "failure_detail": event.detail,
        "upstream_status": event.upstream_status,
        "upstream_code": event.upstream_code,
        "upstream_param": event.upstream_param,
        "retry_after_s": event.retry_after_s,
        "failure_answered": False,
    }
    return with_current(state, _evolve(attempt, failed))


def _on_fenced(state: RequestState, event: AttemptFenced) -> Changes:
    attempt = live_current(state, event)
    if event.waiting_for == FenceWait.CONNECTION_CLOSE and (state.first_delta_sent or not attempt.aborts_on_close):
        raise illegal(state, event, "only a replica that aborts on close, before any delivery, is fenced by closing")
    changes = with_current(state, _evolve(attempt, {"fenced": True, "waiting_for": event.waiting_for}))
    changes["pending"] = state.pending - {ActionName.FENCE_ATTEMPT}
    return changes


def _on_cancel_sent(state: RequestState, event: CancelSent) -> Changes:
    attempt = unreleased(state, event)
    changes = with_attempt(state, _evolve(attempt, {"cancel_sent": True}))
    changes["pending"] = state.pending - {ActionName.CANCEL_ATTEMPT}
    return changes


def _on_cancel_acked(state: RequestState, event: CancelAcked) -> Changes:
    attempt = unreleased(state, event)
    if not attempt.cancel_sent:
        raise illegal(state, event, "no cancel was sent to this attempt")
    if event.generated_tokens is not None and event.generated_tokens < 0:
        raise illegal(state, event, "negative generated token count")
    return with_attempt(state, _evolve(attempt, {"cancel_acked": True}))


def _on_lease_expired(state: RequestState, event: LeaseExpired) -> Changes:
    attempt = unreleased(state, event)
    return with_attempt(state, _evolve(attempt, {"lease_expired": True}))


def _on_released(state: RequestState, event: AttemptReleased) -> Changes:
    attempt = unreleased(state, event)
    if event.because is ReleaseReason.CANCEL_ACKED and not attempt.cancel_acked:
        raise illegal(state, event, "released for a cancel ack that was not recorded")
    if event.because is ReleaseReason.LEASE_EXPIRED and not attempt.lease_expired:
        raise illegal(state, event, "released for a lease expiry that was not recorded")
    if event.because is ReleaseReason.CONNECTION_CLOSED and attempt.waiting_for != FenceWait.CONNECTION_CLOSE:
        raise illegal(state, event, "released by a closed connection without a fence that waits for one")
    if state.phase is Phase.FENCED and (state.first_delta_sent or not attempt.fenced):
        raise illegal(state, event, "only the fenced attempt of an undelivered request reopens prefill")
    return with_attempt(state, _evolve(attempt, {"released": event.because}))


def _on_client_disconnected(state: RequestState, event: ClientDisconnected) -> Changes:
    if state.client_gone:
        raise illegal(state, event, "the client already disconnected")
    if event.resume_grace_s < 0:
        raise illegal(state, event, "a negative resume grace")
    return {"client_gone": True, "resume_grace_s": event.resume_grace_s, "disconnects": state.disconnects + 1}


def _on_client_resumed(state: RequestState, event: ClientResumed) -> Changes:
    if not state.client_gone or not state.awaits_a_client:
        raise illegal(state, event, "no client left within a grace that is still running")
    if event.after < -1:
        raise illegal(state, event, "after is a delta index or -1")
    return {"client_gone": False}


def _on_grace_expired(state: RequestState, event: ResumeGraceExpired) -> Changes:
    if not state.client_gone or state.background or not state.awaits_a_client:
        raise illegal(state, event, "no resume grace is running")
    return {"resume_grace_expired": True}


def _on_retry_wait_elapsed(state: RequestState, event: RetryWaitElapsed) -> Changes:
    if ActionName.WAIT_TO_RETRY not in state.pending:
        raise illegal(state, event, "no wait to retry was decided")
    return {"pending": state.pending - {ActionName.WAIT_TO_RETRY}, "waited_for": event.replica_id}


def _on_completed(state: RequestState, event: RequestCompleted) -> Changes:
    current = state.current_attempt
    if current is None or not current.live:
        raise illegal(state, event, "no running attempt completed the request")
    unknown = sorted({event.finish_reason, *event.finish_reasons} - FINISH_REASONS)
    if unknown:
        raise illegal(state, event, f"unknown finish reason {unknown[0]!r}")
    if any(count < 0 for count in event.usage.values()):
        raise illegal(state, event, "negative usage count")
    return {
        "attempts": replaced_last(state.attempts, completed=True),
        "outcome": Outcome.COMPLETED,
        "finish_reason": event.finish_reason,
        "pending": frozenset(),
    }


def _on_failed(state: RequestState, event: RequestFailed) -> Changes:
    if event.delivered_output_tokens != state.delivered_output_tokens:
        raise illegal(state, event, "delivered_output_tokens disagrees with the deliveries")
    if event.partial_output != state.first_delta_sent:
        raise illegal(state, event, "partial_output disagrees with the commit point")
    return {"outcome": Outcome.FAILED, "error_code": event.code, "pending": frozenset()}


def _on_stream_resumed(state: RequestState, event: StreamResumed) -> Changes:
    if not 0 <= event.from_index <= event.to_index <= max(state.delivered_deltas, state.produced_deltas):
        raise illegal(state, event, f"deltas [{event.from_index}, {event.to_index}) were never delivered")
    # the most any reader was shown (docs/design.md §15): the reader then had every delta
    # before ``to_index``. delivered_deltas stays what was delivered live: it is where the
    # log's produced tail starts (app/api/resume/log.py); read_deltas keeps the reads' most
    return {
        "delivered_output_tokens": max(state.delivered_output_tokens, event.tokens),
        "read_deltas": max(state.read_deltas, event.to_index),
    }


def _on_cancelled(state: RequestState, event: RequestCancelled) -> Changes:
    return {"outcome": Outcome.CANCELLED, "error_code": event.reason, "pending": frozenset()}


# Any: each handler takes its own event type, which the table's key guarantees
HANDLERS: dict[type[Event], Callable[[RequestState, Any], Changes]] = {
    RequestAccepted: _on_accepted,
    Decided: _on_decided,
    AttemptStarted: _on_attempt_started,
    NoReplicaAvailable: _on_start_refused,
    RetryBudgetDenied: _on_start_refused,
    FirstTokenReceived: _on_first_token,
    FirstDeltaCommitted: _on_first_delta,
    DeltasDelivered: _on_deltas,
    DeltasProduced: _on_deltas_produced,
    ToolCallEmitted: _on_tool_call,
    UpstreamFailed: _on_upstream_failed,
    AttemptFenced: _on_fenced,
    CancelSent: _on_cancel_sent,
    CancelAcked: _on_cancel_acked,
    LeaseExpired: _on_lease_expired,
    AttemptReleased: _on_released,
    ClientDisconnected: _on_client_disconnected,
    ClientResumed: _on_client_resumed,
    ResumeGraceExpired: _on_grace_expired,
    RetryWaitElapsed: _on_retry_wait_elapsed,
    RequestCompleted: _on_completed,
    RequestFailed: _on_failed,
    RequestCancelled: _on_cancelled,
    StreamResumed: _on_stream_resumed,
}
