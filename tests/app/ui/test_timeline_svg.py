"""The timeline picture, drawn from events alone: what each golden trace puts on it."""

from __future__ import annotations

import dataclasses
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from app.ui.page import render_page
from app.ui.timeline_svg import render_timeline
from statemachine import events as ev
from statemachine.events import Event
from statemachine.replay import replay
from statemachine.trace import parse_trace
from tests.statemachine.model import ModelDriver

TRACES = Path(__file__).resolve().parents[2] / "traces"
SVG = "{http://www.w3.org/2000/svg}"


def golden(name: str) -> list[Event]:
    (events,) = parse_trace((TRACES / f"{name}.jsonl").read_text().splitlines()).requests.values()
    return events


def marks(events: list[Event]) -> list[dict[str, str]]:
    """Every mark of the drawing as its data attributes (the SVG parses as XML)."""
    root = ET.fromstring(render_timeline(events, replay(events)))
    return [dict(g.attrib) for g in root.iter(f"{SVG}g") if "data-mark" in g.attrib]


def kinds(found: list[dict[str, str]], attempt: str | None = None) -> list[str]:
    return [m["data-mark"] for m in found if attempt is None or m.get("data-attempt") == attempt]


def first(found: list[dict[str, str]], kind: str) -> dict[str, str]:
    return next(m for m in found if m["data-mark"] == kind)


def test_a_retry_before_the_first_delta_draws_two_attempt_lanes_and_one_commit_point() -> None:
    found = marks(golden("retry_before_first_delta"))
    assert first(found, "attempt")["data-ended"] == "replica_exited"
    assert [m["data-ended"] for m in found if m["data-mark"] == "attempt"] == ["replica_exited", "completed"]
    assert kinds(found, "1") == ["attempt", "lease", "start", "first-token", "failure"]
    assert "delivery" in kinds(found, "2") and "failure" not in kinds(found, "2")
    commit = first(found, "commit-point")
    assert commit["data-attempt"] == "2"
    assert int(first(found, "failure")["data-seq"]) < int(
        commit["data-seq"]
    )  # failed before anything reached the client
    assert kinds(found).count("decision") == 2 and "request-completed" in kinds(found)


def test_a_decode_interruption_fails_after_the_commit_point_with_no_second_attempt() -> None:
    found = marks(golden("decode_interrupted"))
    assert {m.get("data-attempt") for m in found if m["data-mark"] == "attempt"} == {"1"}
    assert int(first(found, "failure")["data-seq"]) > int(first(found, "commit-point")["data-seq"])
    assert "request-failed" in kinds(found) and "client-delivery" in kinds(found)
    page = render_page(golden("decode_interrupted"))
    assert "failed: upstream_decode_interrupted" in page and "commit point: no retry after this" in page


def test_a_fence_is_drawn_until_the_lease_expiry_released_it() -> None:
    found = marks(golden("fence_released_by_lease_expiry"))
    assert kinds(found, "1") == [
        "attempt",
        "lease",
        "start",
        "fence",
        "failure",
        "cancel-sent",
        "lease-expired",
        "released",
    ]
    assert first(found, "attempt")["data-ended"] == "lease_expired"


def test_the_divergent_decision_is_marked_with_what_is_recomputed() -> None:
    events = golden("divergent_soft_timeout_migrated")
    found = marks(events)
    (diverged,) = [m for m in found if m["data-mark"] == "diverged-decision"]
    assert diverged["data-seq"] == "5"
    svg = render_timeline(events, replay(events))
    assert "≠ recomputed wait(overloaded_soft_timeout)" in svg
    assert "First divergence at seq 5" in render_page(events)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("client_disconnect", {"client-gone", "request-cancelled", "cancel-sent", "cancel-acked", "released"}),
        ("tool_call_replayed", {"tool-call", "request-completed"}),
        ("clean_completion", {"first-token", "delivery", "client-delivery", "commit-point", "request-completed"}),
        ("client_resumed_within_grace", {"client-gone", "production", "client-attached", "request-completed"}),
        ("resume_grace_expired", {"client-gone", "production", "grace-expired", "request-cancelled", "cancel-acked"}),
    ],
)
def test_each_golden_trace_draws_its_marks(name: str, expected: set[str]) -> None:
    assert expected <= set(kinds(marks(golden(name))))


def test_text_from_the_log_is_escaped() -> None:
    driver = ModelDriver("req_<b>")
    driver.first_token()
    driver.deliver(1, "<script>alert(1)</script>")
    driver.complete()
    page = render_page(driver.events)
    assert "<script>" not in page and "&lt;script&gt;" in page
    ET.fromstring(render_timeline(driver.events, None))  # still well-formed


def test_an_in_flight_request_and_a_broken_log_still_draw() -> None:
    driver = ModelDriver("req_live")
    driver.first_token()
    assert first(marks(driver.events), "attempt")["data-ended"] == "running"
    broken = [*driver.events, dataclasses.replace(driver.events[0], seq=driver.state.seq + 1)]  # accepted twice
    page = render_page(broken)
    assert "The log breaks the state machine" in page
    with pytest.raises(ValueError, match="at least one event"):
        render_timeline([], None)


def test_a_lease_is_placed_between_the_events_around_its_end() -> None:
    driver = ModelDriver("req_lease")
    driver.fail(ev.FailureKind.LIVENESS_UNCERTAIN)
    driver.lease_expires()
    driver.first_token()
    driver.deliver(1, "x")
    driver.complete()
    root = ET.fromstring(render_timeline(driver.events, None))
    lease_lines = [
        float(line.attrib["x2"])
        for g in root.iter(f"{SVG}g")
        if g.attrib.get("data-mark") == "lease"
        for line in g.iter(f"{SVG}line")
    ]
    assert len(lease_lines) == 2 and all(x > 0 for x in lease_lines)


def test_a_resumed_stream_is_marked_on_the_client_lane() -> None:
    driver = ModelDriver("req_resumed")
    driver.deliver(3)
    driver.complete()
    driver.record(ev.StreamResumed, from_index=1, to_index=3, gateway="gw_b")
    delivered = 3
    page = render_page(driver.events)
    assert 'data-mark="client-resumed"' in page and f"resumed: deltas 1-{delivered}" in page
