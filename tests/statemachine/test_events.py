"""The events' JSON form: lossless round trips and clear rejections."""

from __future__ import annotations

import dataclasses
import enum
import json
import typing
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from statemachine import events as ev
from statemachine.deltas import ChoicePromptLogprobs, ChoicePrompts, ChoicePromptTokens, DeltaLogprobs, DeltaTokenIds
from statemachine.errors import MalformedEvent, UnknownEventType
from statemachine.events import EVENT_TYPES, Event, is_attempt_scoped
from statemachine.jsonform import from_json, to_json
from tests.statemachine.model import T0


def sample_value(annotation: Any) -> Any:
    args = typing.get_args(annotation)
    if type(None) in args:
        (inner,) = (arg for arg in args if arg is not type(None))
        return sample_value(inner)
    if annotation is datetime:
        return T0 + timedelta(microseconds=123457)
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return list(annotation)[-1]
    samples = {str: "sample é ✓", int: 42, float: 2.5, bool: True, tuple[str, ...]: ("w1", "w2")}
    if annotation in samples:
        return samples[annotation]
    if annotation == dict[str, int]:
        return {"prompt_tokens": 3, "completion_tokens": 5}
    if annotation == tuple[tuple[int, int, int], ...]:
        return ((0, 4, 1), (1, 6, 2))
    if annotation == DeltaLogprobs:
        # an echoed prompt's first token has none: (token, None, ())
        return ((("sa", -0.25, (("sa", -0.25), ("mp", -1.0))), ("echo", None, ())), ())
    if annotation == DeltaTokenIds:
        return ((918, 705), ())
    if annotation == ChoicePrompts:
        return ((0, (1, 4, 78), "<|user|>hi"), (1, None, None))
    if annotation == ChoicePromptTokens:
        return ((0, 12), (1, 0))
    if annotation == ChoicePromptLogprobs:
        # the prompt's first token has none; a rank or a text may be unknown; -9999.0 is -inf clamped
        return ((0, (None, ((5, -0.5, 1, " hi"), (9, -9999.0, None, None)))), (1, (None,)))
    if annotation == tuple[str | int | None, ...]:
        return ("stop string", 7, None)
    return {"attempt": 2, "exclude_replicas": ["w1"], "nested": {"ok": None}}


def sample_event(cls: type[Event], request_id: str = "req_s", seq: int = 1) -> Event:
    hints = typing.get_type_hints(cls)
    values = {f.name: sample_value(hints[f.name]) for f in dataclasses.fields(cls)}
    values.update(request_id=request_id, seq=seq)
    return cls(**values)


ALL_TYPES = sorted(EVENT_TYPES.values(), key=lambda cls: cls.__name__)


@pytest.mark.parametrize("cls", [cls for cls in ALL_TYPES if cls.ADDED], ids=lambda cls: cls.__name__)
def test_an_event_is_written_in_the_oldest_form_that_holds_it(cls: type[Event]) -> None:
    """Its later fields at their defaults: written as before them, so the logs of an
    earlier release read the same; with one of them set, in the version that added it."""
    hints = typing.get_type_hints(cls)
    added = {name for names in cls.ADDED.values() for name in names}
    defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.name in added}
    plain = dataclasses.replace(sample_event(cls), **defaults)
    form = to_json(plain)
    assert form["v"] == 1 and not added & set(form["body"])
    assert from_json(form) == plain
    for version, names in cls.ADDED.items():
        name = names[0]
        rich = dataclasses.replace(plain, **{name: sample_value(hints[name])})
        form = to_json(rich)
        assert form["v"] == version and name in form["body"]
        assert from_json(form) == rich
        older = {**form, "v": version - 1}  # an older form cannot hold it: refused, named
        with pytest.raises(MalformedEvent, match="unexpected"):
            from_json(older)


@pytest.mark.parametrize("cls", [cls for cls in ALL_TYPES if cls.WIDENED], ids=lambda cls: cls.__name__)
def test_a_value_in_a_wider_form_is_written_in_the_version_that_allows_it(cls: type[Event]) -> None:
    """A token sent under another name than its text (``token_id:<id>``) carries its text
    fourth: written at the version that widened ``logprobs``; every other token as before."""
    ((version, (name,)),) = cls.WIDENED.items()
    later = {name for added_in, names in cls.ADDED.items() if added_in > version for name in names}
    event = dataclasses.replace(
        sample_event(cls), **{f.name: f.default for f in dataclasses.fields(cls) if f.name in later}
    )
    narrow = to_json(event)
    assert narrow["v"] < version
    named = (("token_id:918", -0.25, (("token_id:918", -0.25),), "sa"), ("token_id:705", -1.0, ()))
    wide = dataclasses.replace(event, **{name: (named, ())})
    form = json.loads(json.dumps(to_json(wide)))
    assert form["v"] == version  # (the fields a later version added at their defaults)
    assert form["body"][name][0][0] == ["token_id:918", -0.25, [["token_id:918", -0.25]], "sa"]
    assert form["body"][name][0][1] == ["token_id:705", -1.0, []]  # its text is its own: three
    assert from_json(form) == wide


@pytest.mark.parametrize("cls", ALL_TYPES, ids=lambda cls: cls.__name__)
def test_round_trip_is_lossless_through_json_text(cls: type[Event]) -> None:
    event = sample_event(cls)
    text = json.dumps(to_json(event))
    assert from_json(json.loads(text)) == event


@pytest.mark.parametrize("cls", ALL_TYPES, ids=lambda cls: cls.__name__)
def test_events_are_frozen_slotted_and_versioned(cls: type[Event]) -> None:
    event = sample_event(cls)
    assert cls.SCHEMA_VERSION >= 1
    assert not hasattr(event, "__dict__")
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.seq = 5  # type: ignore[misc]


def test_attempt_scope_is_in_the_envelope() -> None:
    started = to_json(sample_event(EVENT_TYPES["AttemptStarted"]))
    assert started["attempt"] == 42 and started["lease_epoch"] == 42
    assert "attempt" not in started["body"]
    accepted = to_json(sample_event(EVENT_TYPES["RequestAccepted"]))
    assert "attempt" not in accepted
    assert is_attempt_scoped(EVENT_TYPES["CancelAcked"])
    assert not is_attempt_scoped(EVENT_TYPES["Decided"])


def test_enums_and_times_are_plain_json() -> None:
    failed = to_json(sample_event(EVENT_TYPES["UpstreamFailed"]))
    assert type(failed["body"]["kind"]) is str
    assert failed["occurred_at"].endswith("+00:00")


@given(
    detail=st.text(),
    seq=st.integers(min_value=1, max_value=2**62),
    micros=st.integers(min_value=0, max_value=10**12),
    offset_minutes=st.integers(min_value=-600, max_value=600),
)
def test_round_trip_holds_for_any_text_seq_and_time(detail: str, seq: int, micros: int, offset_minutes: int) -> None:
    tz = timezone(timedelta(minutes=offset_minutes))
    event = dataclasses.replace(
        sample_event(EVENT_TYPES["UpstreamFailed"]),
        detail=detail,
        seq=seq,
        occurred_at=(T0 + timedelta(microseconds=micros)).astimezone(tz),
    )
    assert from_json(json.loads(json.dumps(to_json(event)))) == event


def _broken(change: dict[str, Any], body_change: dict[str, Any] | None = None, drop: str | None = None) -> Any:
    data = to_json(sample_event(EVENT_TYPES["DeltasDelivered"]))
    data.update(change)
    if body_change:
        data["body"] = {**data["body"], **body_change}
    if drop:
        data["body"].pop(drop)
    return data


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (["not", "an", "object"], "must be a JSON object"),
        (_broken({"v": 99}), "unsupported schema version 99"),
        (_broken({"seq": "1"}), "DeltasDelivered.seq: expected int, got str"),
        (_broken({"seq": True}), "DeltasDelivered.seq: expected int, got bool"),
        (_broken({"attempt": None}), "DeltasDelivered.attempt: expected int"),
        (_broken({"occurred_at": "2026-11-30T12:00:00"}), "has no UTC offset"),
        (_broken({"occurred_at": "yesterday"}), "DeltasDelivered.occurred_at"),
        (_broken({"occurred_at": 5}), "expected an ISO 8601 string"),
        (_broken({"body": "text"}), "body must be a JSON object"),
        (_broken({}, drop="tokens"), "body has missing tokens"),
        (_broken({}, {"surprise": 1}), "body has unexpected surprise"),
        (_broken({}, {"text": 5}), "DeltasDelivered.text: expected str"),
        (_broken({"extra": 1}), "envelope has unexpected extra"),
        (_broken({}, {"logprobs": ["sa"]}), "DeltasDelivered.logprobs: expected per delta a list"),
        (_broken({}, {"logprobs": [["sa", -0.5, []]]}), "expected \\[token, logprob"),
        (_broken({}, {"logprobs": [[["sa", 0.5, []]]]}), "a number at most 0"),
        (_broken({}, {"logprobs": [[["sa", True, []]]]}), "a number at most 0"),
        (_broken({}, {"logprobs": [[["sa", -0.5, [["x"]]]]]}), "expected \\[alternative, logprob\\]"),
        (_broken({}, {"logprobs": [[[5, -0.5, []]]]}), "expected a token string"),
        (_broken({}, {"logprobs": [[["sa", -0.5, [], 7]]]}), "expected a token string"),
        (_broken({}, {"logprobs": [[["sa", -0.5, [], "s", "a"]]]}), "expected \\[token, logprob"),
    ],
)
def test_malformed_events_are_rejected_by_name(data: Any, message: str) -> None:
    with pytest.raises(MalformedEvent, match=message.replace("(", r"\(")):
        from_json(data)


def test_missing_envelope_field_is_named() -> None:
    data = to_json(sample_event(EVENT_TYPES["Decided"]))
    del data["request_id"]
    with pytest.raises(MalformedEvent, match="envelope has missing request_id"):
        from_json(data)


def test_a_whole_number_of_seconds_is_read_as_seconds() -> None:
    data = to_json(sample_event(EVENT_TYPES["ClientDisconnected"]))
    data["body"]["resume_grace_s"] = 10
    event = from_json(data)
    assert isinstance(event, ev.ClientDisconnected) and event.resume_grace_s == 10.0


@pytest.mark.parametrize(
    ("type_name", "field", "value", "message"),
    [
        ("UpstreamFailed", "kind", "gremlins", "'gremlins' is not one of replica_exited"),
        ("UpstreamFailed", "kind", 3, "expected a string"),
        ("NoReplicaAvailable", "excluded", ["w1", 2], "expected a list of strings"),
        ("RequestCompleted", "usage", {"tokens": "many"}, "expected an object of integers"),
        ("Decided", "params", [], "expected an object"),
        ("DeltasDelivered", "deltas", [[0, 4]], r"expected a list of \[choice, characters, tokens\]"),
        ("DeltasDelivered", "deltas", [[0, -1, 1]], "expected a list of"),
        ("DeltasDelivered", "deltas", [[0, True, 1]], "expected a list of"),
        ("DeltasDelivered", "deltas", {"0": 1}, "expected a list of"),
        ("ClientDisconnected", "resume_grace_s", True, "expected a number, got bool"),
        ("ClientDisconnected", "resume_grace_s", "10", "expected a number, got str"),
    ],
)
def test_wrong_body_types_are_rejected(type_name: str, field: str, value: Any, message: str) -> None:
    data = to_json(sample_event(EVENT_TYPES[type_name]))
    data["body"][field] = value
    with pytest.raises(MalformedEvent, match=message):
        from_json(data)


@pytest.mark.parametrize("type_name", ["Gremlin", None, 7])
def test_unknown_types_are_rejected(type_name: Any) -> None:
    with pytest.raises(UnknownEventType, match="unknown event type"):
        from_json({"type": type_name, "v": 1})


def test_optional_body_fields_may_be_omitted() -> None:
    data = to_json(sample_event(EVENT_TYPES["UpstreamFailed"]))
    for name in ("deadline", "upstream_status", "upstream_code"):
        del data["body"][name]
    event = from_json(data)
    assert event.deadline is None  # type: ignore[union-attr]
