"""Writing traces: deterministic lines, canonical nested order, redaction, legality by line."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from statemachine import events as ev
from statemachine.errors import TraceError
from statemachine.events import FailureKind
from statemachine.policy_config import PolicyConfig
from statemachine.replay import replay
from statemachine.trace import REDACTED_FIELDS, dump_trace, fold_trace, parse_trace, trace_header, trace_line
from tests.statemachine.model import ModelDriver

TRACES = Path(__file__).resolve().parents[1] / "traces"


def jsonb_order(values: dict[str, object]) -> dict[str, object]:
    """Keys as PostgreSQL's jsonb gives them back: shorter first, then bytewise."""
    return {key: values[key] for key in sorted(values, key=lambda key: (len(key), key))}


@pytest.mark.parametrize("path", sorted(TRACES.glob("*.jsonl")), ids=lambda p: p.stem)
def test_a_golden_trace_is_rewritten_byte_for_byte_even_from_reordered_objects(path: Path) -> None:
    text = path.read_text()
    trace = parse_trace(text.splitlines())
    shuffled = []
    for event in sorted(trace.events, key=lambda e: trace.line_of(e.request_id, e.seq)):
        if isinstance(event, ev.Decided):
            event = dataclasses.replace(event, params=jsonb_order(event.params))
        elif isinstance(event, ev.RequestCompleted):
            event = dataclasses.replace(event, usage=jsonb_order(event.usage))  # type: ignore[arg-type]
        shuffled.append(event)
    meta = {key: value for key, value in trace.header.items() if key not in ("format", "version", "requests")}
    assert "".join(dump_trace(shuffled, meta)) == text


def test_nested_objects_of_unknown_shape_are_sorted() -> None:
    driver = ModelDriver("req_sorted")
    decided = ev.Decided("req_sorted", 9, driver.events[0].occurred_at, "old_action", "r", "v0", {"b": 1, "a": 2})
    assert list(json.loads(trace_line(decided))["body"]["params"]) == ["a", "b"]
    done = ev.RequestCompleted("req_sorted", 9, decided.occurred_at, "stop", {"z": 1, "total_tokens": 3})
    assert list(json.loads(trace_line(done))["body"]["usage"]) == ["total_tokens", "z"]


def test_a_redacted_trace_drops_what_the_client_was_sent_and_says_so() -> None:
    driver = ModelDriver("req_redacted", tools=True)
    driver.first_token()
    driver.tool_call()
    driver.deliver(3, "my secret ")
    driver.complete()
    prompt = ((0, (None, ((9, -0.5, 1, " passport"),))),)  # the decoded prompt: content too
    events = [
        dataclasses.replace(e, arguments='{"card": "4111"}')
        if isinstance(e, ev.ToolCallEmitted)
        else dataclasses.replace(e, prompt_logprobs=prompt)
        if isinstance(e, ev.DeltasDelivered)
        else e
        for e in driver.events
    ]
    lines = list(dump_trace(events, {"incident": "INC-7"}, redact=True))
    header = json.loads(lines[0])
    assert header["incident"] == "INC-7" and header["redacted"] == list(REDACTED_FIELDS)
    assert "secret" not in "".join(lines) and "4111" not in "".join(lines) and "passport" not in "".join(lines)
    trace = parse_trace(lines)
    (delivered,) = [e for e in trace.events if isinstance(e, ev.DeltasDelivered)]
    (call,) = [e for e in trace.events if isinstance(e, ev.ToolCallEmitted)]
    assert delivered.text is None and delivered.tokens == 3 and call.arguments == ""
    assert replay(trace.requests["req_redacted"]).ok  # decisions never read the text


def test_the_header_line_keeps_the_format_fields_first() -> None:
    assert json.loads(trace_header(["req_a", "req_b"], {"source": "x"})) == {
        "format": "phasegate-trace",
        "version": 1,
        "requests": ["req_a", "req_b"],
        "source": "x",
    }


def test_fold_trace_folds_every_request() -> None:
    a, b = ModelDriver("req_a"), ModelDriver("req_b")
    b.fail(FailureKind.REPLICA_EXITED)
    states = fold_trace(parse_trace(dump_trace([*a.events, *b.events])))
    assert states == {"req_a": a.state, "req_b": b.state}


def test_an_illegal_event_is_refused_naming_its_line() -> None:
    driver = ModelDriver("req_bad")
    driver.first_token()
    driver.deliver(2, "x")
    lines = list(dump_trace(driver.events))
    # a delivery from an attempt that never committed the first delta: legal JSON, illegal request
    deliver = json.loads(lines[-1])
    deliver["attempt"] = 2
    lines[-1] = json.dumps(deliver) + "\n"
    with pytest.raises(TraceError, match=rf"^line {len(lines)}: can't handle event DeltasDelivered") as caught:
        fold_trace(parse_trace(lines))
    assert caught.value.line == len(lines)


def test_every_decision_run_is_kept_with_what_the_policy_says_now() -> None:
    driver = ModelDriver("req_runs")
    driver.fail(FailureKind.REPLICA_EXITED)
    driver.fail(FailureKind.REPLICA_EXITED)  # the budget of 2 is spent: failed
    result = replay(driver.events, PolicyConfig(max_attempts=3))
    assert [run.agrees for run in result.runs] == [True, True, False]
    assert result.runs[-1].recomputed[0]["action"] == "start_attempt"
    assert result.divergence is not None and result.divergence.seq == result.runs[-1].seq


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("x{}", r"line 3: not valid JSON \(Expecting value\)"),
        ("{} {}", r"line 3: not valid JSON \(Extra data after the event\)"),
        ('{"type": "Decided", "v": 1,', r"line 3: not valid JSON .*is the line truncated\?"),
    ],
)
def test_a_line_that_is_not_one_json_value_is_named(line: str, message: str) -> None:
    lines = list(dump_trace(ModelDriver("req_json").events))
    with pytest.raises(TraceError, match=message):
        parse_trace([lines[0], lines[1], line])


def test_blank_lines_before_the_header_are_skipped_and_lines_keep_their_numbers() -> None:
    lines = list(dump_trace(ModelDriver("req_blank").events))
    trace = parse_trace(["\n", "  \n", *lines])
    assert trace.line_of("req_blank", 1) == 4 and trace.line_of("req_blank", 99) == 0
