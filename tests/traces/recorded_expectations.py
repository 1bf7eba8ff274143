"""What each trace recorded from a real gateway (tests/traces/recorded/) must show.

``python -m tests.traces.record`` checks a fresh recording against these before it
writes it, so a run that went another way (a fault that missed, a race lost) is never
checked in; ``tests/statemachine/test_recorded_traces.py`` checks the checked-in files
against them again. Pure: events in, assertions out.
"""

from __future__ import annotations

from collections.abc import Callable

from statemachine import events as ev
from statemachine.events import FailureKind, ReleaseReason
from statemachine.request_state import Outcome
from statemachine.state import fold


def _of(events: list[ev.Event], cls: type[ev.Event]) -> list[ev.Event]:
    return [e for e in events if isinstance(e, cls)]


def _index(events: list[ev.Event], cls: type[ev.Event], attempt: int | None = None) -> int:
    return next(
        i
        for i, e in enumerate(events)
        if isinstance(e, cls) and (attempt is None or getattr(e, "attempt", None) == attempt)
    )


def _replicas(events: list[ev.Event]) -> list[str]:
    return [e.replica_id for e in _of(events, ev.AttemptStarted)]  # type: ignore[attr-defined]


def _published_by(events: list[ev.Event]) -> set[int]:
    return {e.attempt for e in _of(events, ev.DeltasDelivered) + _of(events, ev.FirstDeltaCommitted)}  # type: ignore[attr-defined]


def _delivered_tokens(events: list[ev.Event]) -> int:
    return sum(e.tokens for e in _of(events, ev.DeltasDelivered))  # type: ignore[attr-defined]


def _retried_after_a_death(events: list[ev.Event]) -> None:
    assert fold(events).outcome is Outcome.COMPLETED
    one, two = _replicas(events)
    assert one != two
    (failed,) = _of(events, ev.UpstreamFailed)
    assert failed.attempt == 1 and failed.kind is FailureKind.REPLICA_EXITED  # type: ignore[attr-defined]
    assert _published_by(events) == {2}


def retry_before_first_delta(events: list[ev.Event]) -> None:
    _retried_after_a_death(events)
    assert _of(events, ev.RequestAccepted)[0].stream  # type: ignore[attr-defined]


def whole_answer_retried(events: list[ev.Event]) -> None:
    """``stream: false``: attempt 1 produced tokens, none reached the client, so it was retried."""
    _retried_after_a_death(events)
    assert not _of(events, ev.RequestAccepted)[0].stream  # type: ignore[attr-defined]
    assert 1 in {e.attempt for e in _of(events, ev.FirstTokenReceived)}  # type: ignore[attr-defined]


def _interrupted(events: list[ev.Event]) -> ev.RequestFailed:
    state = fold(events)
    assert state.outcome is Outcome.FAILED and len(_replicas(events)) == 1
    (terminal,) = _of(events, ev.RequestFailed)
    assert isinstance(terminal, ev.RequestFailed)
    assert (terminal.code, terminal.partial_output, terminal.retryable) == ("upstream_decode_interrupted", True, False)
    assert terminal.delivered_output_tokens == _delivered_tokens(events) == state.delivered_output_tokens > 0
    return terminal


def decode_interrupted(events: list[ev.Event]) -> None:
    _interrupted(events)


def choices_interrupted(events: list[ev.Event]) -> None:
    _interrupted(events)
    assert _of(events, ev.RequestAccepted)[0].n == 2  # type: ignore[attr-defined]


def fence_released_by_lease_expiry(events: list[ev.Event]) -> None:
    """A network cut during prefill: attempt 1 fenced, its cancel never acknowledged, its
    lease lapsed, and only then attempt 2 started."""
    assert fold(events).outcome is Outcome.COMPLETED and len(_replicas(events)) == 2
    (failed,) = _of(events, ev.UpstreamFailed)
    assert failed.attempt == 1 and failed.kind is FailureKind.LIVENESS_UNCERTAIN  # type: ignore[attr-defined]
    released = [e for e in _of(events, ev.AttemptReleased) if e.attempt == 1]  # type: ignore[attr-defined]
    assert [r.because for r in released] == [ReleaseReason.LEASE_EXPIRED]  # type: ignore[attr-defined]
    assert not [e for e in _of(events, ev.CancelAcked) if e.attempt == 1]  # type: ignore[attr-defined]
    fenced = _index(events, ev.AttemptFenced, 1)
    expired = _index(events, ev.LeaseExpired, 1)
    assert fenced < expired < _index(events, ev.AttemptReleased, 1) < _index(events, ev.AttemptStarted, 2)
    assert _published_by(events) == {2}


def fence_released_by_connection_close(events: list[ev.Event]) -> None:
    """An ``openai`` replica sent no first token within ``openai_first_token_s``: attempt 1
    fenced by closing its connection, released so with no lease waited out, then retried."""
    assert fold(events).outcome is Outcome.COMPLETED and len(_replicas(events)) == 2
    (failed,) = _of(events, ev.UpstreamFailed)
    assert failed.attempt == 1 and failed.kind is FailureKind.LIVENESS_UNCERTAIN  # type: ignore[attr-defined]
    assert failed.detail.startswith("no first token within")  # type: ignore[attr-defined]
    (fenced,) = _of(events, ev.AttemptFenced)
    assert fenced.waiting_for == "connection_close"  # type: ignore[attr-defined]
    released = [e for e in _of(events, ev.AttemptReleased) if e.attempt == 1]  # type: ignore[attr-defined]
    assert [r.because for r in released] == [ReleaseReason.CONNECTION_CLOSED]  # type: ignore[attr-defined]
    assert not _of(events, ev.LeaseExpired) and not _of(events, ev.CancelAcked)
    assert (
        _index(events, ev.AttemptFenced, 1)
        < _index(events, ev.AttemptReleased, 1)
        < _index(events, ev.AttemptStarted, 2)
    )
    assert _published_by(events) == {2}


def client_disconnect(events: list[ev.Event]) -> None:
    assert fold(events).outcome is Outcome.CANCELLED and len(_replicas(events)) == 1
    order = [
        _index(events, cls)
        for cls in (ev.FirstDeltaCommitted, ev.ClientDisconnected, ev.CancelSent, ev.CancelAcked, ev.AttemptReleased)
    ]
    assert order == sorted(order)
    (released,) = _of(events, ev.AttemptReleased)
    assert released.because is ReleaseReason.CANCEL_ACKED  # type: ignore[attr-defined]
    assert _delivered_tokens(events) > 0


def client_resumed_within_grace(events: list[ev.Event]) -> None:
    """The client left mid-answer; deltas were produced with no client attached; a
    resumer attached within the grace and received them and the rest."""
    state = fold(events)
    assert state.outcome is Outcome.COMPLETED and len(_replicas(events)) == 1
    order = [_index(events, cls) for cls in (ev.ClientDisconnected, ev.DeltasProduced, ev.ClientResumed)]
    assert order == sorted(order) and not _of(events, ev.CancelSent)
    assert state.delivered_deltas == state.produced_deltas  # everything produced was then delivered


def resume_grace_expired(events: list[ev.Event]) -> None:
    """The client left mid-answer and never came back: the grace ran out, then the cancel."""
    state = fold(events)
    assert state.outcome is Outcome.CANCELLED and len(_replicas(events)) == 1
    order = [
        _index(events, cls)
        for cls in (ev.ClientDisconnected, ev.DeltasProduced, ev.ResumeGraceExpired, ev.CancelSent, ev.CancelAcked)
    ]
    assert order == sorted(order)
    assert state.produced_deltas > state.delivered_deltas > 0


def tool_call_replayed(events: list[ev.Event]) -> None:
    """The replica died right after asking for a tool; the retry asked for the same call."""
    _retried_after_a_death(events)
    emitted = _of(events, ev.ToolCallEmitted)
    assert [e.attempt for e in emitted] == [1, 2]  # type: ignore[attr-defined]
    assert len({e.idempotency_key for e in emitted}) == 1  # type: ignore[attr-defined]


EXPECTED: dict[str, Callable[[list[ev.Event]], None]] = {
    "retry_before_first_delta": retry_before_first_delta,
    "whole_answer_retried": whole_answer_retried,
    "decode_interrupted": decode_interrupted,
    "choices_interrupted": choices_interrupted,
    "fence_released_by_lease_expiry": fence_released_by_lease_expiry,
    "fence_released_by_connection_close": fence_released_by_connection_close,
    "client_disconnect": client_disconnect,
    "client_resumed_within_grace": client_resumed_within_grace,
    "resume_grace_expired": resume_grace_expired,
    "tool_call_replayed": tool_call_replayed,
}
