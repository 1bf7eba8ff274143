"""The rows the event-log benchmarks append (ops/bench/eventlog.py): a request opened to its
commit point, then one-token deliveries; and a scratch database to append them to."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import UTC, date, datetime, timedelta

import asyncpg

from app.store.codec import EventRow, accept_day, to_row
from app.store.database import asyncpg_dsn, sqlalchemy_url
from statemachine.events import AttemptStarted, DeltasDelivered, Event, FirstDeltaCommitted, RequestAccepted

T0 = datetime(2026, 11, 30, 17, 0, tzinfo=UTC)


def opening(request_id: str) -> list[Event]:
    """Accepted, attempt 1 started, first delta committed: deliveries may follow."""
    accepted = RequestAccepted(
        request_id=request_id,
        seq=1,
        occurred_at=T0,
        model="bench-model",
        model_revision="r1",
        tenant="bench",
        endpoint="chat.completions",
        stream=True,
        params_digest="d",
        prompt_tokens=32,
        n=1,
        guided=False,
        tools=False,
        idempotency_key=None,
        max_attempts=2,
        seed=None,
    )
    return [
        accepted,
        AttemptStarted(request_id, 2, T0, 1, 1, "w1", T0 + timedelta(seconds=30)),
        FirstDeltaCommitted(request_id, 3, T0, 1, 1),
    ]


def delivery(request_id: str, index: int) -> DeltasDelivered:
    """The ``index``-th delivery (0-based), seq ``4 + index``."""
    at = T0 + timedelta(microseconds=index)
    return DeltasDelivered(request_id, 4 + index, at, 1, 1, index, index + 1, 1, " tok", None)


def dayed_row(event: Event) -> EventRow:
    """The row of ``event`` with its request's accept day, as the store writes it."""
    return to_row(event, accept_day(T0))


def moved(events: Sequence[Event], day: date) -> list[Event]:
    """``events`` (of a request accepted at :data:`T0`) as if accepted on ``day``."""
    shift = datetime.combine(day, T0.timetz()) - T0
    return [dataclasses.replace(event, occurred_at=event.occurred_at + shift) for event in events]


def rows_on(events: Sequence[Event], day: date) -> list[EventRow]:
    """The rows of ``events`` moved to ``day`` (:func:`moved`), as the store writes them."""
    return [to_row(event, day) for event in moved(events, day)]


def params_of(event: Event) -> dict[str, object]:
    """The row of ``event`` as named parameters ``p1``, ``p2``, … (SQLAlchemy Core's form)."""
    return {f"p{n}": value for n, value in enumerate(dayed_row(event), start=1)}


async def scratch_database(url: str, name: str) -> str:
    admin = await asyncpg.connect(asyncpg_dsn(url))
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}"')
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    from sqlalchemy.engine import make_url

    return make_url(sqlalchemy_url(url)).set(database=name).render_as_string(hide_password=False)
