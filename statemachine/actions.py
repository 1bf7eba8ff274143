"""The policy's actions: what ``decide()`` returns and a ``Decided`` event records.

Each is a frozen value whose fields, ``reason`` aside, are the ``Decided`` event's
``params`` (:func:`action_params`), so replay compares what was recorded with what
the policy says now, parameter by parameter.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from statemachine.request_state import ActionName, FenceWait
from statemachine.routing import PoolSnapshot


@dataclass(frozen=True, slots=True)
class StartAttempt:
    name: ClassVar[ActionName] = ActionName.START_ATTEMPT
    reason: str
    attempt: int
    exclude_replicas: tuple[str, ...]
    migration: str | None  # None for the first attempt, else "new_request", "prefill_retry" or "model_fallback"
    # where it goes (statemachine.routing): None when no replica can take it (NoReplicaAvailable follows)
    replica: str | None = None
    model: str = ""
    placement: str = ""  # why there
    pool: PoolSnapshot | None = None  # what the placement saw


@dataclass(frozen=True, slots=True)
class WaitToRetry:
    """Retry on the same replica once ``wait_s`` (its ``Retry-After``) has passed:
    carried out by a timer, recorded as ``RetryWaitElapsed``."""

    name: ClassVar[ActionName] = ActionName.WAIT_TO_RETRY
    reason: str
    attempt: int  # the attempt that failed
    replica: str
    wait_s: float
    pool: PoolSnapshot


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


Action = StartAttempt | WaitToRetry | FenceAttempt | CancelAttempt | Wait | FailRequest | CancelRequest

ACTION_TYPES: dict[str, type[Action]] = {
    cls.name: cls for cls in (StartAttempt, WaitToRetry, FenceAttempt, CancelAttempt, Wait, FailRequest, CancelRequest)
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
        elif isinstance(value, PoolSnapshot):
            value = value.to_params()
        params[name] = value
    return params


def action_params_order(action: type[Action]) -> tuple[str, ...]:
    """The names of an action's parameters, in the order ``action_params`` gives them."""
    return _PARAMS[action]


# Each action's parameters, in field order (replay recomputes them for every decision).
_PARAMS: dict[type[Action], tuple[str, ...]] = {
    cls: tuple(f.name for f in fields(cls) if f.name != "reason") for cls in ACTION_TYPES.values()
}


def fail_before_output(
    reason: str, *, code: str, message: str, http_status: int, retryable: bool = True
) -> FailRequest:
    """Fail a request of which nothing was delivered (docs/design.md §6: ``partial_output`` false)."""
    return FailRequest(
        reason=reason,
        code=code,
        message=message,
        partial_output=False,
        delivered_output_tokens=0,
        retryable=retryable,
        http_status=http_status,
    )
