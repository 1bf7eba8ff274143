"""Events to rows and back (pure: no database)."""

from __future__ import annotations

import json
from datetime import timedelta, timezone

import pytest

from app.store.codec import event_id, from_row, storable, to_row
from app.store.errors import InvalidAppend
from ops import traces
from statemachine.events import (
    EVENT_TYPES,
    AttemptFenced,
    ClientResumed,
    Deadline,
    DeltasDelivered,
    DeltasProduced,
    Event,
    FailureKind,
    NoReplicaAvailable,
    ResumeGraceExpired,
    RetryBudgetDenied,
    RetryWaitElapsed,
    StreamResumed,
    UpstreamFailed,
)
from statemachine.jsonform import to_json

T0 = traces.T0


def one_of_each() -> list[Event]:
    """At least one event of every type, from the scenarios plus the rarer ones."""
    samples: dict[str, Event] = {}
    for scenario in (
        traces.completed,
        traces.retried_before_first_delta,
        traces.fenced_then_retried,
        traces.interrupted_in_decode,
        traces.stalled_in_decode,
        traces.cancelled_by_client,
        traces.with_tool_call,
    ):
        for event in scenario("req_codec").events:
            samples.setdefault(type(event).__name__, event)
    for event in (
        RetryBudgetDenied("req_codec", 9, T0, "global"),
        NoReplicaAvailable("req_codec", 9, T0, ("w1", "w2"), "all ejected"),
        UpstreamFailed("req_codec", 9, T0, 2, 3, FailureKind.OVERLOADED, "queued", Deadline.SOFT, 503, "busy"),
        StreamResumed("req_codec", 9, T0, 0, 2, "gw_b"),
        ClientResumed("req_codec", 9, T0, 4, "gw_b"),
        ResumeGraceExpired("req_codec", 9, T0),
        RetryWaitElapsed("req_codec", 9, T0, "w1"),
        DeltasProduced("req_codec", 9, T0, 1, 1, 5, 7, 2, "ab", None, ((0, 1, 1), (0, 1, 1))),
    ):
        samples[type(event).__name__] = event
    assert set(samples) == set(EVENT_TYPES)
    return list(samples.values())


@pytest.mark.parametrize("event", one_of_each(), ids=lambda event: type(event).__name__)
def test_a_row_holds_the_events_json_form_and_reads_back_equal(event: Event) -> None:
    row = to_row(event)
    form = to_json(event)
    assert json.loads(row.body) == form["body"]
    assert (row.request_id, row.version, row.type, row.schema_version) == (
        form["request_id"],
        form["seq"],
        form["type"],
        form["v"],
    )
    assert (row.attempt, row.lease_epoch) == (form.get("attempt"), form.get("lease_epoch"))
    stored = from_row(
        row.request_id,
        row.version,
        row.type,
        row.schema_version,
        row.attempt,
        row.lease_epoch,
        row.occurred_at,
        row.body,
    )
    assert stored == event


def test_an_events_id_is_its_content() -> None:
    fenced = AttemptFenced("req_id", 5, T0, 1, 1, "cancel_ack_or_lease_expiry")
    same_instant_elsewhere = AttemptFenced(
        "req_id", 5, T0.astimezone(timezone(timedelta(hours=5))), 1, 1, "cancel_ack_or_lease_expiry"
    )
    assert event_id(fenced) == event_id(same_instant_elsewhere)  # PostgreSQL keeps the instant only
    for different in (
        AttemptFenced("req_id", 5, T0 + timedelta(microseconds=1), 1, 1, "cancel_ack_or_lease_expiry"),
        AttemptFenced("req_id", 5, T0, 1, 2, "cancel_ack_or_lease_expiry"),
        AttemptFenced("req_id", 6, T0, 1, 1, "cancel_ack_or_lease_expiry"),
        AttemptFenced("req_other", 5, T0, 1, 1, "cancel_ack_or_lease_expiry"),
        AttemptFenced("req_id", 5, T0, 1, 1, "lease_expiry"),
    ):
        assert event_id(different) != event_id(fenced)


def test_event_ids_grow_with_time() -> None:
    early = AttemptFenced("req_z", 5, T0, 1, 1, "x")
    late = AttemptFenced("req_a", 5, T0 + timedelta(milliseconds=1), 1, 1, "x")
    assert str(event_id(early)) < str(event_id(late))  # the unique index grows at its right edge


def test_an_event_json_cannot_hold_is_refused_as_an_invalid_append() -> None:
    beyond_64_bits = DeltasDelivered("req_id", 9, T0, 1, 1, 0, 1, 2**64, "x", None)
    with pytest.raises(InvalidAppend, match="DeltasDelivered cannot be recorded"):
        to_row(beyond_64_bits)


@pytest.mark.parametrize("surrogate", ["\ud800", "\udc00"], ids=["high", "low"])
def test_a_lone_surrogate_anywhere_is_refused_as_an_invalid_append(surrogate: str) -> None:
    in_the_body = DeltasDelivered("req_id", 9, T0, 1, 1, 0, 1, 1, f"a{surrogate}", None)
    in_the_request_id = AttemptFenced(f"req{surrogate}", 5, T0, 1, 1, "x")  # outside the body: a traceback before
    for event in (in_the_body, in_the_request_id):
        with pytest.raises(InvalidAppend, match="cannot be recorded"):
            to_row(event)


def test_u0000_is_recorded_as_a_replacement_character() -> None:
    delta = DeltasDelivered("req_id", 9, T0, 1, 1, 0, 1, 1, "a\x00b", None)
    row = to_row(delta)
    assert json.loads(row.body)["text"] == "a\N{REPLACEMENT CHARACTER}b"  # jsonb cannot hold U+0000
    typed = DeltasDelivered("req_id", 9, T0, 1, 1, 0, 1, 1, "a\\u0000b", None)  # typed out, not U+0000
    assert json.loads(to_row(typed).body)["text"] == "a\\u0000b"
    replacement = "\N{REPLACEMENT CHARACTER}"
    assert storable({"k\x00": ("x\x00", 1, None)}) == {f"k{replacement}": [f"x{replacement}", 1, None]}
