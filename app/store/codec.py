"""Events to rows of ``request_events`` and back, through the events' JSON form.

The envelope goes to columns (``seq`` is the row's ``version``), the body to jsonb.
Each row also carries its request's ``accepted_on``, the partition key (migration
0007): the UTC day of the request's ``RequestAccepted``, which the store supplies
for the events after it (:mod:`app.store.postgres`).

Each event's id is derived from the event itself, so appending the very same event
again, or re-importing a recorded trace, finds the row already there: 48 bits of
``occurred_at`` in milliseconds, then 80 bits of the SHA-256 of its canonical form
(the envelope, then the body's JSON with sorted keys). The time prefix keeps the
unique index's inserts near its right edge instead of scattered over every page.
``occurred_at`` is digested as microseconds since the epoch, the instant without its
offset, because that is what PostgreSQL keeps: an event read back and appended
again has the same id.

PostgreSQL's text, and so jsonb, cannot hold U+0000, which a model may well emit (a
byte-level tokenizer has a token for byte 0): such characters are recorded as U+FFFD
(:func:`storable`), the client still gets what the model sent.

This runs for every token delivery, so it is written for speed: the body is built
straight from the fields and encoded by orjson (several times faster than the
standard library's encoder; figures: docs/performance.md), and the instant is one
integer division.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import typing
import uuid
from datetime import UTC, date, datetime, timedelta
from typing import Any, NamedTuple

import orjson

from app.store.errors import InvalidAppend
from statemachine.events import EVENT_TYPES, Event, is_attempt_scoped
from statemachine.jsonform import from_json, written_as

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)
_DAY = timedelta(days=1)
_EPOCH_DAY = _EPOCH.date()


class EventRow(NamedTuple):
    """One row of ``request_events`` as the writer inserts it (in its column order)."""

    request_id: str
    version: int
    event_id: str  # 32 hex digits, a uuid for PostgreSQL
    type: str
    schema_version: int
    attempt: int | None
    lease_epoch: int | None
    occurred_at: datetime
    body: str  # JSON text, cast to jsonb by the INSERT
    # the request's accept day (the partition key); None: the INSERT looks it up
    accepted_on: date | None = None


class _Layout(NamedTuple):
    name: str
    attempt_scoped: bool
    datetime_fields: frozenset[str]


def _layout(cls: type[Event]) -> _Layout:
    envelope = {"request_id", "seq", "occurred_at", "attempt", "lease_epoch"}
    hints = typing.get_type_hints(cls)
    fields = [field.name for field in dataclasses.fields(cls) if field.name not in envelope]
    when = frozenset(name for name in fields if datetime in (hints[name], *typing.get_args(hints[name])))
    return _Layout(cls.__name__, is_attempt_scoped(cls), when)


# The body of to_json(), built straight from the fields: this runs for every token
# delivery and to_json's generic walk costs more than the rest of the row. A test
# holds the two equal for every event type.
_LAYOUTS = {cls: _layout(cls) for cls in EVENT_TYPES.values()}


def accept_day(accepted_at: datetime) -> date:
    """The partition key of a request accepted at ``accepted_at``: its UTC day."""
    return _EPOCH_DAY + timedelta(days=(accepted_at - _EPOCH) // _DAY)


def to_row(event: Event, accepted_on: date | None = None) -> EventRow:
    """The row that records ``event`` of a request accepted on ``accepted_on`` (a
    ``RequestAccepted`` is on its own day)."""
    layout = _LAYOUTS[type(event)]
    schema_version, body_fields = written_as(event)  # the oldest form that holds it
    body_form = {name: getattr(event, name) for name in body_fields}
    for name in layout.datetime_fields:
        if body_form.get(name) is not None:
            body_form[name] = body_form[name].isoformat()
    try:
        body = orjson.dumps(body_form, option=orjson.OPT_SORT_KEYS).decode()  # enums by value, tuples as lists
    except orjson.JSONEncodeError as exc:  # an integer beyond 64 bits, a string that is not UTF-8
        raise InvalidAppend(f"{layout.name} cannot be recorded: {exc}") from None
    if "\\u0000" in body:  # rare, and found in C: only then look for the strings that hold U+0000
        body = orjson.dumps(storable(body_form), option=orjson.OPT_SORT_KEYS).decode()
    attempt = event.attempt if layout.attempt_scoped else None  # type: ignore[union-attr]
    lease_epoch = event.lease_epoch if layout.attempt_scoped else None  # type: ignore[union-attr]
    at = event.occurred_at
    micros = (at - _EPOCH) // _MICROSECOND
    canonical = (
        f"{layout.name}\x1f{schema_version}\x1f{event.request_id}\x1f{event.seq}\x1f{attempt}"
        f"\x1f{lease_epoch}\x1f{micros}\x1f{body}"
    )
    millis = (micros // 1000) & 0xFFFF_FFFF_FFFF
    try:
        digest = hashlib.sha256(canonical.encode()).hexdigest()
    except UnicodeEncodeError as exc:  # a lone surrogate outside the body (the request id): not UTF-8
        raise InvalidAppend(f"{layout.name} cannot be recorded: {exc}") from None
    return EventRow(
        event.request_id,
        event.seq,
        f"{millis:012x}{digest[:20]}",
        layout.name,
        schema_version,
        attempt,
        lease_epoch,
        at,
        body,
        accept_day(at) if layout.name == "RequestAccepted" else accepted_on,
    )


def storable(value: Any) -> Any:
    """``value`` with U+0000 in its strings (keys too) replaced by U+FFFD, which
    PostgreSQL's text and jsonb can hold."""
    if isinstance(value, str):
        return value.replace("\x00", "\N{REPLACEMENT CHARACTER}")
    if isinstance(value, dict):
        return {storable(key): storable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [storable(item) for item in value]
    return value


def event_id(event: Event) -> uuid.UUID:
    """The id under which ``event`` is (or would be) recorded."""
    return uuid.UUID(to_row(event).event_id)


def from_row(
    request_id: str,
    version: int,
    type_name: str,
    schema_version: int,
    attempt: int | None,
    lease_epoch: int | None,
    occurred_at: datetime,
    body: str | dict[str, Any],
) -> Event:
    """Rebuild the event of a stored row (validated as any JSON form is)."""
    form: dict[str, Any] = {
        "type": type_name,
        "v": schema_version,
        "request_id": request_id,
        "seq": version,
        "occurred_at": occurred_at.isoformat(),
        "body": json.loads(body) if isinstance(body, str) else body,
    }
    cls = EVENT_TYPES.get(type_name)
    if cls is not None and is_attempt_scoped(cls):
        form["attempt"] = attempt
        form["lease_epoch"] = lease_epoch
    return from_json(form)
