"""``ops/bench/request_events.py`` times each event of a plain request through the steps
the recorder and the store run for it, and prints them whole."""

from __future__ import annotations

import pytest

from ops.bench.request_events import STEPS, measure, plain_request, report
from statemachine import events as ev
from statemachine.state import fold


def test_a_plain_requests_events_are_timed_step_by_step(capsys: pytest.CaptureFixture[str]) -> None:
    events = plain_request(40)
    # what the driver records for it: deliveries in batches of 16 deltas at most
    assert [type(e) for e in events] == [
        ev.RequestAccepted,
        ev.Decided,
        ev.AttemptStarted,
        ev.FirstTokenReceived,
        ev.FirstDeltaCommitted,
        ev.DeltasDelivered,
        ev.DeltasDelivered,
        ev.DeltasDelivered,
        ev.RequestCompleted,
    ]
    assert [e.tokens for e in events if isinstance(e, ev.DeltasDelivered)] == [16, 16, 8]
    assert fold(events).outcome == "completed"
    found = measure(events, 3)
    assert [name for name, _ in found] == [type(e).__name__ for e in events]
    assert all(steps.keys() == set(STEPS) and all(us > 0 for us in steps.values()) for _, steps in found)
    report(found, 40)
    printed = capsys.readouterr().out
    assert "the request" in printed and "RequestAccepted" in printed
