"""The failover policy: ``decide(state, config) -> list[Action]`` (DESIGN.md §5).

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
    upstream refused the request → fail with the upstream's reason, no retry
    a second server error        → poison: fail, not retryable, no more attempts
                                   (the driver counts none of them toward ejection)
    source dead or released      → retry on a replica not yet tried, unless
                                   the budget is spent or the cost guard trips
    a refused start              → fail retryable (no replica / global budget)
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from statemachine.events import Deadline, FailureKind
from statemachine.phases import Phase
from statemachine.request_state import ActionName, AttemptState, FenceWait, RequestState, StartRefusal

POLICY_VERSION = "2026-12-01.3"

# A request that got this many server errors about itself (HTTP 500, an engine failure)
# before any output, on any replicas, is poison: it is failing them, not they it.
POISON_AFTER_SERVER_ERRORS = 2
POISON_REQUEST = "poison_request"


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """The knobs of the policy; replay can run with another one to compare."""

    max_attempts: int = 2
    # Cost guard: a retry whose prompt is longer than this fails fast (None: no guard).
    retry_max_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if self.retry_max_prompt_tokens is not None and self.retry_max_prompt_tokens < 0:
            raise ValueError("retry_max_prompt_tokens must not be negative")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> PolicyConfig:
        """Build from a parsed configuration file, rejecting unknown keys."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown policy settings: {', '.join(unknown)}")
        for name, value in values.items():
            if value is not None and type(value) is not int:
                raise ValueError(f"policy setting {name} must be an integer")
        return cls(**values)


# --- actions -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StartAttempt:
    name: ClassVar[ActionName] = ActionName.START_ATTEMPT
    reason: str
    attempt: int
    exclude_replicas: tuple[str, ...]
    migration: str | None  # None for the first attempt, else "new_request" or "prefill_retry"


@dataclass(frozen=True, slots=True)
class FenceAttempt:
    name: ClassVar[ActionName] = ActionName.FENCE_ATTEMPT
    reason: str
    attempt: int
    wait_for: FenceWait  # what proves the attempt stopped: its replica's cancel ack, or only its lease
    # Before the first delta the request waits for the release (a retry may follow);
    # after it the stream ends at once and the fence completes as bookkeeping.
    request_waits: bool


@dataclass(frozen=True, slots=True)
class CancelAttempt:
    name: ClassVar[ActionName] = ActionName.CANCEL_ATTEMPT
    reason: str
    attempt: int


@dataclass(frozen=True, slots=True)
class Wait:
    name: ClassVar[ActionName] = ActionName.WAIT
    reason: str
    attempt: int


@dataclass(frozen=True, slots=True)
class FailRequest:
    name: ClassVar[ActionName] = ActionName.FAIL_REQUEST
    reason: str
    code: str
    message: str
    partial_output: bool
    delivered_output_tokens: int
    retryable: bool
    http_status: int


@dataclass(frozen=True, slots=True)
class CancelRequest:
    name: ClassVar[ActionName] = ActionName.CANCEL_REQUEST
    reason: str


Action = StartAttempt | FenceAttempt | CancelAttempt | Wait | FailRequest | CancelRequest

ACTION_TYPES: dict[str, type[Action]] = {
    cls.name: cls for cls in (StartAttempt, FenceAttempt, CancelAttempt, Wait, FailRequest, CancelRequest)
}


def action_params(action: Action) -> dict[str, Any]:
    """The action's parameters as JSON values, as a ``Decided`` event stores them."""
    params: dict[str, Any] = {}
    for name in _PARAMS[type(action)]:
        value = getattr(action, name)
        if isinstance(value, tuple):
            value = list(value)
        elif isinstance(value, enum.Enum):
            value = value.value
        params[name] = value
    return params


def action_params_order(action: type[Action]) -> tuple[str, ...]:
    """The names of an action's parameters, in the order ``action_params`` gives them."""
    return _PARAMS[action]


# Each action's parameters, in field order (replay recomputes them for every decision).
_PARAMS: dict[type[Action], tuple[str, ...]] = {
    cls: tuple(f.name for f in fields(cls) if f.name != "reason") for cls in ACTION_TYPES.values()
}


# --- the policy ------------------------------------------------------------------------


def decide(state: RequestState, config: PolicyConfig) -> list[Action]:
    """What to do next for the request, given everything its log says so far."""
    if state.phase in (Phase.NEW, Phase.TERMINATED) or state.pending:
        return []
    current = state.current_attempt
    if state.client_gone and (state.resume_grace_expired or state.resume_grace_s == 0):
        return _on_client_gone(current)
    if state.phase is Phase.FENCED:
        return []  # waiting for the cancel ack or the lease expiry, observed as events
    if state.phase is Phase.DECODE:
        assert current is not None
        return _on_decode_failure(state, current)
    return _in_prefill(state, current, config)


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


def _in_prefill(state: RequestState, current: AttemptState | None, config: PolicyConfig) -> list[Action]:
    if state.start_refused is not None:
        return [_refused_start(state.start_refused)]
    if current is None:
        return [StartAttempt("request_accepted", 1, (), None)]
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
        return [
            _fail_before_output(
                "upstream_refused_request",
                code=current.upstream_code or "upstream_refused_request",
                message=current.failure_detail or "the upstream refused the request",
                http_status=current.upstream_status or 400,
                retryable=False,
            )
        ]
    if current.server_error and sum(a.server_error for a in state.attempts) >= POISON_AFTER_SERVER_ERRORS:
        return [
            _fail_before_output(
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
    return _retry_or_fail(state, current, config)


def _retry_or_fail(state: RequestState, source: AttemptState, config: PolicyConfig) -> list[Action]:
    used = len(state.attempts)
    if used >= config.max_attempts:
        return [
            _fail_before_output(
                "retry_budget_exhausted",
                code="upstream_unavailable",
                message=f"all {used} attempts failed before any output was sent",
                http_status=502,
            )
        ]
    limit = config.retry_max_prompt_tokens
    if limit is not None and state.prompt_tokens > limit:
        return [
            _fail_before_output(
                "retry_cost_guard",
                code="retry_cost_exceeded",
                message=f"a retry would prefill {state.prompt_tokens} prompt tokens, over the limit {limit}",
                http_status=503,
            )
        ]
    migration = "new_request" if source.failure is FailureKind.REJECTED else "prefill_retry"
    reason = source.failure.value if source.failure is not None else (source.ended or "attempt_lost")
    return [StartAttempt(reason, used + 1, tuple(sorted(set(state.replicas_tried))), migration)]


def _refused_start(refused: StartRefusal) -> FailRequest:
    if refused is StartRefusal.RETRY_BUDGET:
        return _fail_before_output(
            "global_retry_budget_denied",
            code="retry_budget_exhausted",
            message="the gateway's retry budget is spent; too many replicas are failing at once",
            http_status=503,
        )
    return _fail_before_output(
        "no_replica_available",
        code="no_replica_available",
        message="no healthy replica is available for this request",
        http_status=503,
    )


def _fail_before_output(
    reason: str, *, code: str, message: str, http_status: int, retryable: bool = True
) -> FailRequest:
    """Fail a request of which nothing was delivered (DESIGN.md §6: ``partial_output`` false)."""
    return FailRequest(
        reason=reason,
        code=code,
        message=message,
        partial_output=False,
        delivered_output_tokens=0,
        retryable=retryable,
        http_status=http_status,
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
