"""Replay of recorded traces: same decisions back, or the divergence named."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from statemachine import events as ev
from statemachine.errors import IllegalTransition, TraceError
from statemachine.jsonform import to_json
from statemachine.policy_config import PolicyConfig
from statemachine.replay import ReplayDivergence, replay
from statemachine.request_state import Outcome
from statemachine.trace import dump_trace, parse_trace
from tests.statemachine.model import ModelDriver
from tests.traces.generate import SCENARIOS

TRACES = Path(__file__).resolve().parents[1] / "traces"
GOLDEN = sorted(path for path in TRACES.glob("*.jsonl") if not path.name.startswith("divergent"))


def load(path: Path):  # type: ignore[no-untyped-def]
    with path.open() as lines:
        return parse_trace(lines)


def test_every_required_golden_trace_is_checked_in() -> None:
    names = {path.stem for path in TRACES.glob("*.jsonl")}
    assert names >= set(SCENARIOS)


@pytest.mark.parametrize("path", GOLDEN, ids=lambda p: p.stem)
def test_golden_traces_replay_without_divergence(path: Path) -> None:
    trace = load(path)
    for request_id, events in trace.requests.items():
        result = replay(events)
        assert result.ok, result.divergence and result.divergence.describe()
        assert result.request_id == request_id
        assert result.final_state.outcome is not None
        assert result.decisions == sum(isinstance(e, ev.Decided) for e in events) > 0
        result.raise_on_divergence()  # does nothing when there is none


def test_the_divergent_trace_is_reported_as_such() -> None:
    (events,) = load(TRACES / "divergent_soft_timeout_migrated.jsonl").requests.values()
    result = replay(events)
    assert result.divergence is not None
    assert result.divergence.seq == 5
    assert result.divergence.recorded == (
        {
            "action": "fence_attempt",
            "reason": "overloaded",
            "params": {"attempt": 1, "wait_for": "cancel_ack_or_lease_expiry"},
        },
    )
    assert result.divergence.recomputed == (
        {"action": "wait", "reason": "overloaded_soft_timeout", "params": {"attempt": 1}},
    )
    assert result.divergence.describe() == (
        "at seq 5: recorded fence_attempt(overloaded), recomputed wait(overloaded_soft_timeout)"
    )
    assert result.final_state.outcome is Outcome.COMPLETED  # the rest still folds
    with pytest.raises(ReplayDivergence, match="request req_divergent diverged at seq 5"):
        result.raise_on_divergence()


def test_replaying_with_another_policy_shows_what_it_would_have_done() -> None:
    (events,) = load(TRACES / "decode_interrupted.jsonl").requests.values()
    assert replay(events, PolicyConfig(max_attempts=3)).ok  # after the first delta: the same end
    driver = ModelDriver("req_budget")
    driver.fail(ev.FailureKind.REPLICA_EXITED)
    driver.fail(ev.FailureKind.REPLICA_EXITED)  # budget of 2 spent: failed
    result = replay(driver.events, PolicyConfig(max_attempts=3))
    assert result.divergence is not None
    assert [d["action"] for d in result.divergence.recomputed] == ["start_attempt"]
    assert "recorded fail_request(retry_budget_exhausted), recomputed start_attempt(replica_exited)" in (
        result.divergence.describe()
    )


def test_without_a_policy_the_budget_comes_from_the_log() -> None:
    driver = ModelDriver("req_one_attempt", config=PolicyConfig(max_attempts=1))
    driver.fail(ev.FailureKind.REPLICA_EXITED)  # a budget of 1, spent: failed at once
    assert driver.events[0].max_attempts == 1  # type: ignore[attr-defined]
    assert replay(driver.events).ok  # as `phasegate replay REQUEST_ID` runs it, with no config
    what_if = replay(driver.events, PolicyConfig(max_attempts=2))  # a given config is the what-if
    assert what_if.divergence is not None
    assert [d["action"] for d in what_if.divergence.recomputed] == ["start_attempt"]


def test_a_missing_decision_at_the_end_is_a_divergence() -> None:
    driver = ModelDriver("req_tail")
    driver.record(ev.UpstreamFailed, **driver.scoped(), kind=ev.FailureKind.REPLICA_EXITED, detail="gone")
    driver.step()
    cut = driver.events[: [type(e) for e in driver.events].index(ev.AttemptStarted, 3)]  # ends on Decided
    assert replay(cut).ok
    tampered = [
        *cut[:-1],
        dataclasses.replace(cut[-1], params={"attempt": 2, "exclude_replicas": [], "migration": "x"}),
    ]
    assert replay(tampered).divergence is not None


def test_generated_traces_match_the_checked_in_ones() -> None:
    for name, scenario in SCENARIOS.items():
        checked_in = (TRACES / f"{name}.jsonl").read_text()
        regenerated = "".join(dump_trace(scenario().events, {"source": "tests/traces/generate.py"}))
        assert checked_in == regenerated, f"{name}: run python -m tests.traces.generate"


def test_an_illegal_trace_raises_rather_than_diverges() -> None:
    events = ModelDriver("req_bad").events
    with pytest.raises(IllegalTransition):
        replay([events[0], events[2]])
    with pytest.raises(ValueError, match="at least one event"):
        replay([])


# --- reading traces ------------------------------------------------------------------


def trace_lines() -> list[str]:
    return list(dump_trace(ModelDriver("req_lines").events))


def test_dump_and_parse_round_trip_several_requests() -> None:
    a, b = ModelDriver("req_a"), ModelDriver("req_b")
    interleaved = [e for pair in zip(a.events, b.events, strict=True) for e in pair]
    trace = parse_trace(dump_trace(interleaved, {"content": "full"}))
    assert trace.header["requests"] == ["req_a", "req_b"] and trace.header["content"] == "full"
    assert trace.requests == {"req_a": a.events, "req_b": b.events}
    assert len(trace.events) == len(interleaved)


@pytest.mark.parametrize(
    ("mangle", "message"),
    [
        (lambda lines: [], "the trace is empty"),
        (lambda lines: ["{}\n", *lines[1:]], "line 1: the first line must be the trace header"),
        (lambda lines: ["not json\n", *lines[1:]], "line 1: the first line must be the trace header"),
        (
            lambda lines: [lines[0].replace('"version": 1', '"version": 9'), *lines[1:]],
            "unsupported trace version 9",
        ),
        (
            lambda lines: [lines[0].replace('["req_lines"]', "[]"), *lines[1:]],
            "must list the trace's request ids",
        ),
        (
            lambda lines: [lines[0].replace('["req_lines"]', '["req_lines", "req_lines"]'), *lines[1:]],
            "lists a request twice",
        ),
        (lambda lines: [*lines[:2], lines[2][:40]], "line 3: not valid JSON .*truncated"),
        (
            lambda lines: [*lines[:2], lines[2].replace("Decided", "Gremlin")],
            "line 3: unknown event type 'Gremlin'",
        ),
        (
            lambda lines: [lines[0], lines[2], lines[1]],
            "line 2: seq 2 of request req_lines does not follow seq 0",
        ),
        (
            lambda lines: [*lines[:2], lines[2].replace("req_lines", "req_other")],
            "line 3: request req_other is not listed",
        ),
        (
            lambda lines: [lines[0].replace('["req_lines"]', '["req_lines", "req_x"]'), *lines[1:]],
            "no events for .*req_x",
        ),
    ],
)
def test_bad_traces_name_the_line(mangle, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(TraceError, match=message):
        parse_trace(mangle(trace_lines()))


def test_blank_lines_are_ignored() -> None:
    lines = trace_lines()
    assert parse_trace([lines[0], "\n", *lines[1:], "  \n"]).requests["req_lines"] == ModelDriver("req_lines").events


def test_trace_lines_are_event_json() -> None:
    lines = trace_lines()
    assert json.loads(lines[1]) == to_json(ModelDriver("req_lines").events[0])


def test_a_recorded_decision_where_none_was_due_is_a_divergence() -> None:
    driver = ModelDriver("req_extra")
    extra = ev.Decided(driver.request_id, driver.state.seq + 1, driver.events[-1].occurred_at, "wait", "x", "old", {})
    result = replay([*driver.events, extra])
    assert result.divergence is not None
    assert result.divergence.describe() == f"at seq {extra.seq}: recorded wait(x), recomputed no action"
