"""The failover policy: ``decide(state, config, pool) -> list[Action]`` (docs/design.md §5).

Pure: no I/O, no clock, no randomness. The driver calls it after every batch of
observations, records each action as a ``Decided`` event (with ``POLICY_VERSION``)
and then carries the actions out; a recorded action stays *pending* in the state
until the event that shows it done arrives, and while anything is pending the
policy decides nothing new, so calling it twice never doubles an action.

The rule it serves: a request is re-run on another replica only while nothing of
it has reached the client, and only once the source attempt is dead or released.

    client gone, grace over      → cancel the live attempt, cancel the request
                                   (within resume_grace_s it goes on as if attached)
    decode, failure              → [fence a live source,] fail upstream_decode_interrupted
    overloaded on a soft timer   → wait (record it once), never migrate
    live source, other failure   → fence: cancel sent, then ack or lease expiry; before
                                   any delivery, a replica that aborts on a closed
                                   connection is released once it is closed
    upstream refused the request → its fallback model, else fail with the upstream's
                                   reason, no retry
    a second server error        → poison: fail, not retryable, no more attempts
                                   (the driver counts none of them toward ejection)
    source dead or released      → the same replica after its Retry-After, another
                                   replica, a fallback model (statemachine.placing),
                                   unless the budget is spent or the cost guard trips
    a refused start              → a fallback model, else fail retryable (no
                                   replica / global budget)

Where an attempt goes is decided here too, over a snapshot of the pool that the
driver passes in and the ``Decided`` event records (:mod:`statemachine.routing`).
"""

from __future__ import annotations

from typing import Any

from statemachine.actions import (
    Action,
    CancelAttempt,
    CancelRequest,
    FailRequest,
    FenceAttempt,
    Wait,
    action_params,
    fail_before_output,
)
from statemachine.events import Deadline, FailureKind
from statemachine.phases import Phase
from statemachine.placing import CONTENT_POLICY_CODES, CONTEXT_LENGTH_EXCEEDED, fallback, retry_or_fail, start
from statemachine.policy_config import PolicyConfig
from statemachine.request_state import AttemptState, RequestState, StartRefusal
from statemachine.routing import PoolSnapshot

POLICY_VERSION = "2026-12-04.1"  # a background response is never cancelled for want of a client

# A request that got this many server errors about itself (HTTP 500, an engine failure)
# before any output, on any replicas, is poison: it is failing them, not they it.
POISON_AFTER_SERVER_ERRORS = 2
POISON_REQUEST = "poison_request"


# --- the policy ------------------------------------------------------------------------


def needs_pool(state: RequestState) -> bool:
    """Whether ``decide()`` may place an attempt now: the driver then passes it a
    snapshot of the pool (taken only then, never on the per-token path)."""
    if state.phase is not Phase.PREFILL or state.pending:
        return False
    current = state.current_attempt
    return current is None or not current.live


def decide(state: RequestState, config: PolicyConfig, pool: PoolSnapshot | None = None) -> list[Action]:
    """What to do next for the request, given everything its log says so far and,
    where an attempt is placed (:func:`needs_pool`), the pool as it is now."""
    if state.phase in (Phase.NEW, Phase.TERMINATED) or state.pending:
        return []
    current = state.current_attempt
    if state.client_gone and not state.awaits_a_client:
        return _on_client_gone(current)
    if state.phase is Phase.FENCED:
        return []  # waiting for the cancel ack or the lease expiry, observed as events
    if state.phase is Phase.DECODE:
        assert current is not None
        return _on_decode_failure(state, current)
    return _in_prefill(state, current, config, pool)


def _on_client_gone(current: AttemptState | None) -> list[Action]:
    actions: list[Action] = []
    if current is not None and current.live and not current.cancel_sent:
        actions.append(CancelAttempt("client_gone", current.attempt))
    actions.append(CancelRequest("client_gone"))
    return actions


def _on_decode_failure(state: RequestState, current: AttemptState) -> list[Action]:
    if current.failure is None or current.failure_answered:
        return []
    if _soft_overload(current):
        return [Wait("overloaded_soft_timeout", current.attempt)]
    actions: list[Action] = []
    if current.live:
        # the stream ends at once; the fence completes afterwards as bookkeeping
        reason = f"{current.failure.value}_after_first_delta"
        wait_for = current.fence_wait(delivered=True)
        actions.append(FenceAttempt(reason, current.attempt, wait_for, request_waits=False))
    actions.append(
        FailRequest(
            reason="failure_after_first_delta",
            code="upstream_decode_interrupted",
            message="generation stopped after part of the answer was sent",
            partial_output=True,
            delivered_output_tokens=state.delivered_output_tokens,
            retryable=False,
            http_status=502,
        )
    )
    return actions


def _in_prefill(
    state: RequestState, current: AttemptState | None, config: PolicyConfig, pool: PoolSnapshot | None
) -> list[Action]:
    if state.start_refused is not None:
        if state.start_refused is StartRefusal.NO_REPLICA:
            chosen = fallback(state, config, pool, state.routing.fallbacks, "no replica available")
            if chosen is not None:
                return [chosen]
        return [_refused_start(state.start_refused)]
    if current is None:
        return [start(state, pool, "request_accepted", migration=None)]
    if current.live:
        if current.failure is None or current.failure_answered:
            return []
        if _soft_overload(current):
            return [Wait("overloaded_soft_timeout", current.attempt)]
        # liveness uncertain (or a hard deadline on a slow replica): fence it first; nothing
        # was delivered, so a replica that aborts on a closed connection is fenced by closing it
        wait_for = current.fence_wait(delivered=False)
        return [FenceAttempt(current.failure.value, current.attempt, wait_for, request_waits=True)]
    if current.failure is FailureKind.REQUEST_REFUSED:
        code = current.upstream_code or "upstream_refused_request"
        chain = state.routing.context_window_fallbacks if code == CONTEXT_LENGTH_EXCEEDED else ()
        chain = state.routing.content_policy_fallbacks if code in CONTENT_POLICY_CODES else chain
        chosen = fallback(state, config, pool, chain, code)
        if chosen is not None:
            return [chosen]
        return [
            fail_before_output(
                "upstream_refused_request",
                code=code,
                message=current.failure_detail or "the upstream refused the request",
                http_status=current.upstream_status or 400,
                retryable=False,
            )
        ]
    if current.server_error and sum(a.server_error for a in state.attempts) >= POISON_AFTER_SERVER_ERRORS:
        return [
            fail_before_output(
                POISON_REQUEST,
                code=POISON_REQUEST,
                message=(
                    f"the request failed with a server error on {POISON_AFTER_SERVER_ERRORS} attempts before "
                    "any output; it is treated as poison and not retried"
                ),
                http_status=502,
                retryable=False,
            )
        ]
    return retry_or_fail(state, current, config, pool)


def _refused_start(refused: StartRefusal) -> FailRequest:
    if refused is StartRefusal.RETRY_BUDGET:
        return fail_before_output(
            "global_retry_budget_denied",
            code="retry_budget_exhausted",
            message="the gateway's retry budget is spent; too many replicas are failing at once",
            http_status=503,
        )
    return fail_before_output(
        "no_replica_available",
        code="no_replica_available",
        message="no healthy replica is available for this request",
        http_status=503,
    )


def ended_by_gateway(state: RequestState, code: str, message: str) -> FailRequest:
    """The gateway itself ends the request (it was lost, it drains): not a decision
    about the replicas, so never recorded as ``Decided``; what the client is told
    follows what the log says was delivered."""
    partial = state.first_delta_sent
    return FailRequest(
        reason=code,
        code=code,
        message=message,
        partial_output=partial,
        delivered_output_tokens=state.delivered_output_tokens,
        retryable=not partial,
        http_status=503,
    )


def _soft_overload(attempt: AttemptState) -> bool:
    return attempt.failure is FailureKind.OVERLOADED and attempt.failure_deadline is not Deadline.HARD


def decided_fields(action: Action) -> dict[str, Any]:
    """The body of the ``Decided`` event that records ``action``."""
    return {
        "action": action.name.value,
        "reason": action.reason,
        "policy_version": POLICY_VERSION,
        "params": action_params(action),
    }
