"""The events an attempt's or a request's outcome is recorded as: the policy's decision,
the request's failure, an attempt stopped for good (its cancel acknowledged, or its lease
expired) or closed unproven, each through the request's :class:`~app.driver.recorder.Recorder`.
"""

from __future__ import annotations

from app.driver.recorder import Recorder
from statemachine import events as ev
from statemachine.actions import Action, FailRequest
from statemachine.events import ReleaseReason
from statemachine.policy import decided_fields


def record_decided(recorder: Recorder, action: Action) -> None:
    recorder.record(ev.Decided, **decided_fields(action))


def record_failed(recorder: Recorder, action: FailRequest) -> None:
    """The request failed as ``action`` says (the terminal event)."""
    recorder.record(
        ev.RequestFailed,
        code=action.code,
        message=action.message,
        partial_output=action.partial_output,
        delivered_output_tokens=action.delivered_output_tokens,
        retryable=action.retryable,
    )


def record_stopped(recorder: Recorder, attempt: int, lease_epoch: int, generated_tokens: int | None) -> None:
    """The attempt stopped for good: its cancel acknowledged (with what it had
    generated), or, with ``None``, its lease expired; then it is released."""
    scope = {"attempt": attempt, "lease_epoch": lease_epoch}
    if generated_tokens is not None:
        recorder.record(ev.CancelAcked, **scope, generated_tokens=generated_tokens)
        recorder.record(ev.AttemptReleased, **scope, because=ReleaseReason.CANCEL_ACKED)
    else:
        recorder.record(ev.LeaseExpired, **scope)
        recorder.record(ev.AttemptReleased, **scope, because=ReleaseReason.LEASE_EXPIRED)


def record_closed(recorder: Recorder, attempt: int, lease_epoch: int) -> None:
    """The attempt's stream is closed, which is its fence (a replica that aborts on
    a closed connection, before any delivery): it is released, unproven."""
    recorder.record(
        ev.AttemptReleased, attempt=attempt, lease_epoch=lease_epoch, because=ReleaseReason.CONNECTION_CLOSED
    )
