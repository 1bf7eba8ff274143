"""The invariants checker names each broken rule, and passes every legal history."""

from __future__ import annotations

import dataclasses

from statemachine import events as ev
from statemachine.events import FailureKind
from statemachine.invariants import violations
from statemachine.policy_config import PolicyConfig
from tests.statemachine.model import ModelDriver
from tests.traces.generate import SCENARIOS


def test_every_golden_history_keeps_every_rule() -> None:
    for name, scenario in SCENARIOS.items():
        if not name.startswith("divergent"):
            assert violations(scenario().events) == [], name
    divergent = violations(SCENARIOS["divergent_soft_timeout_migrated"]().events)
    assert divergent == [
        "decision diverged at seq 5: recorded fence_attempt(overloaded), recomputed wait(overloaded_soft_timeout)"
    ]


def completed() -> list[ev.Event]:
    driver = ModelDriver("req_inv")
    driver.deliver(2)
    driver.complete()
    return driver.events


def test_each_rule_is_named() -> None:
    events = completed()
    assert violations([]) == ["the request has no events"]
    assert "seq has a gap or a repeat" in violations([events[0], *events[2:]])
    other = dataclasses.replace(events[-1], request_id="req_other")
    assert "events of several requests are mixed" in violations([*events[:-1], other])
    assert violations(events[:-1]) == ["0 terminal events"]
    extra = ev.RequestCancelled("req_inv", len(events) + 1, events[-1].occurred_at, "again")
    assert "2 terminal events" in violations([*events, extra])


def test_overlaps_and_splices_are_found_in_a_forged_history() -> None:
    driver = ModelDriver("req_forged", config=PolicyConfig(max_attempts=3))
    driver.deliver(1)
    t = driver.events[-1].occurred_at
    seq = driver.state.seq
    forged = [
        *driver.events,
        ev.AttemptStarted("req_forged", seq + 1, t, 2, 2, "w2", t),
        ev.DeltasDelivered("req_forged", seq + 2, t, 2, 2, 1, 2, 1, "y", None),
        ev.RequestCompleted("req_forged", seq + 3, t, "stop", {}),
    ]
    found = violations(forged)
    assert "attempt 2 started while an earlier one could still publish" in found
    assert "attempts [1, 2] all delivered output: a splice" in found


def test_a_history_the_state_machine_refuses_is_named_illegal() -> None:
    events = completed()
    fenced = ev.AttemptFenced("req_inv", 4, events[3].occurred_at, 1, 1, "x")
    broken = [*events[:3], fenced, *[dataclasses.replace(e, seq=e.seq + 1) for e in events[3:]]]
    (found,) = violations(broken)
    assert found.startswith("illegal: can't handle event FirstDeltaCommitted in phase fenced")


def test_a_dead_attempt_may_be_followed_by_the_next() -> None:
    driver = ModelDriver("req_dead")
    driver.fail(FailureKind.REPLICA_EXITED)
    driver.deliver(1)
    driver.complete()
    assert violations(driver.events) == []
