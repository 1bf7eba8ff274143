"""Traces recorded from a real gateway (tests/traces/recorded/, ``python -m tests.traces.record``)
replay with today's policy without divergence, keep every invariant, and show what
their scenario is about.

The golden traces next to them are written by the pure model that replay checks;
these were written by the real driver over real workers and PostgreSQL, so they catch
a driver that records decisions, events or orders the policy and the fold would not.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from statemachine import events as ev
from statemachine.invariants import violations
from statemachine.replay import replay
from statemachine.trace import Trace, parse_trace
from tests.traces.recorded_expectations import EXPECTED

RECORDED = Path(__file__).resolve().parents[1] / "traces" / "recorded"
PATHS = sorted(RECORDED.glob("*.jsonl"))


def load(path: Path) -> Trace:
    with path.open() as lines:
        return parse_trace(lines)


def only_request(trace: Trace) -> list[ev.Event]:
    (events,) = trace.requests.values()
    return list(events)


def test_every_scenario_is_recorded() -> None:
    assert {path.stem for path in PATHS} == set(EXPECTED)


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.stem)
def test_a_trace_recorded_from_a_real_gateway_replays_without_divergence(path: Path) -> None:
    trace = load(path)
    assert (trace.header["source"], trace.header["scenario"]) == ("tests/traces/record.py", path.stem)
    events = only_request(trace)
    assert violations(events) == []
    result = replay(events)
    assert result.ok, result.divergence and result.divergence.describe()
    assert result.decisions == sum(isinstance(e, ev.Decided) for e in events) > 0
    assert result.final_state.outcome is not None
    EXPECTED[path.stem](events)
    accepted = events[0]
    assert isinstance(accepted, ev.RequestAccepted) and accepted.gateway  # written by a gateway instance


def test_a_retry_decision_tampered_with_in_a_recorded_trace_is_named_as_the_divergence() -> None:
    """The replay test above can fail: the retry's recorded exclusion list, emptied."""
    events = only_request(load(RECORDED / "retry_before_first_delta.jsonl"))
    (retry,) = [e for e in events if isinstance(e, ev.Decided) and e.params.get("attempt") == 2]
    assert retry.params["exclude_replicas"], "the recorded retry excluded the dead replica"
    tampered = dataclasses.replace(retry, params={**retry.params, "exclude_replicas": []})
    result = replay([tampered if e is retry else e for e in events])
    assert result.divergence is not None and result.divergence.seq == retry.seq
