"""Read-side queries for incident tools: pick requests, read their events in bulk, summarise one.

Each function takes an open SQLAlchemy ``AsyncConnection`` (from
:meth:`PostgresEventStore.reading` in the gateway, or a plain engine in the CLI), so
the callers decide about pooling and transactions. Requests are selected through the
``requests`` read model (indexed by ``accepted_at`` and ``model``); events always come
from ``request_events`` itself, the log, in seq order per request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Text, any_, bindparam, select, text
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.ext.asyncio import AsyncConnection

from app.store import schema
from app.store.codec import from_row
from statemachine.events import TERMINAL_EVENTS, Event

OUTCOMES = ("completed", "failed", "cancelled", "unfinished")


def ended(accepted: str) -> str:
    """SQL: the request of ``accepted`` (an alias of ``request_events``) has its terminal
    event in the log, found through its day's stream key; no read model asked."""
    types = ", ".join(f"'{terminal.__name__}'" for terminal in TERMINAL_EVENTS)
    return (
        f"EXISTS (SELECT 1 FROM request_events ended WHERE ended.request_id = {accepted}.request_id"
        f" AND ended.accepted_on = {accepted}.accepted_on AND ended.type IN ({types}))"
    )


_EVENT_COLUMNS = (
    schema.request_events.c.request_id,
    schema.request_events.c.version,
    schema.request_events.c.type,
    schema.request_events.c.schema_version,
    schema.request_events.c.attempt,
    schema.request_events.c.lease_epoch,
    schema.request_events.c.occurred_at,
    schema.request_events.c.body,
)


@dataclass(frozen=True, slots=True)
class Selection:
    """Which requests to take: accepted in ``[since, until)``, of ``model``, ended with ``outcome``."""

    since: datetime | None = None
    until: datetime | None = None
    model: str | None = None
    outcome: str | None = None  # one of OUTCOMES; "unfinished": no terminal event yet
    limit: int | None = None

    def __post_init__(self) -> None:
        if self.outcome is not None and self.outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {', '.join(OUTCOMES)}, not {self.outcome!r}")


async def select_requests(connection: AsyncConnection, selection: Selection) -> list[str]:
    """The ids of the selected requests, oldest first."""
    requests = schema.requests.c
    query = select(requests.request_id).order_by(requests.accepted_at, requests.request_id)
    if selection.since is not None:
        query = query.where(requests.accepted_at >= selection.since)
    if selection.until is not None:
        query = query.where(requests.accepted_at < selection.until)
    if selection.model is not None:
        query = query.where(requests.model == selection.model)
    if selection.outcome == "unfinished":
        query = query.where(requests.outcome.is_(None))
    elif selection.outcome is not None:
        query = query.where(requests.outcome == selection.outcome)
    if selection.limit is not None:
        query = query.limit(selection.limit)
    return list((await connection.scalars(query)).all())


async def known_requests(connection: AsyncConnection, request_ids: Sequence[str]) -> set[str]:
    """Those of ``request_ids`` that have at least one event in the log (their RequestAccepted)."""
    events = schema.request_events.c
    ids = bindparam("request_ids", value=list(request_ids), type_=ARRAY(Text))
    query = select(events.request_id).where(events.request_id == any_(ids), events.version == 1)
    return set((await connection.scalars(query)).all())


async def read_requests(
    connection: AsyncConnection, request_ids: Sequence[str], *, chunk: int = 500
) -> AsyncIterator[list[Event]]:
    """Each request's events (in the order of ``request_ids``; unknown ids are skipped).

    One query per ``chunk`` requests, so replaying a night's log neither runs a query
    per request nor holds the whole night in memory.
    """
    for start in range(0, len(request_ids), chunk):
        ids = list(request_ids[start : start + chunk])
        streams: dict[str, list[Event]] = {request_id: [] for request_id in ids}
        events = schema.request_events.c
        query = select(*_EVENT_COLUMNS).where(events.request_id.in_(ids)).order_by(events.request_id, events.version)
        for row in await connection.execute(query):
            streams[row.request_id].append(from_row(*row))
        for request_id in ids:
            if streams[request_id]:
                yield streams[request_id]


async def stream_in_log_order(connection: AsyncConnection, request_ids: Sequence[str]) -> AsyncIterator[Event]:
    """The events of ``request_ids`` in the order the log recorded them (its positions).

    Rows come through a server-side cursor and the ids as one array parameter, so a
    night's export holds neither every event in memory nor a parameter per request.
    """
    events = schema.request_events.c
    ids = bindparam("request_ids", value=list(request_ids), type_=ARRAY(Text))
    query = select(*_EVENT_COLUMNS).where(events.request_id == any_(ids)).order_by(events.position)
    result = await connection.stream(query)
    async for row in result:
        yield from_row(*row)


async def events_page(connection: AsyncConnection, request_id: str, *, after_seq: int, limit: int) -> list[Event]:
    """At most ``limit`` events of the request with seq above ``after_seq``, in seq order."""
    events = schema.request_events.c
    query = (
        select(*_EVENT_COLUMNS)
        .where(events.request_id == request_id, events.version > after_seq)
        .order_by(events.version)
        .limit(limit)
    )
    return [from_row(*row) for row in await connection.execute(query)]


@dataclass(frozen=True, slots=True)
class RequestSummary:
    """One request as the read models tell it: its ``requests`` row and its ``request_attempts``
    rows, every column as it is (timestamps as datetimes)."""

    request: dict[str, Any]
    attempts: list[dict[str, Any]]
    trace_id: str | None = None  # the request's OpenTelemetry trace, as RequestAccepted recorded it


async def request_summary(connection: AsyncConnection, request_id: str) -> RequestSummary | None:
    """The read models' rows of the request, or ``None`` if the log has no such request."""
    found = await connection.execute(text("SELECT * FROM requests WHERE request_id = :id"), {"id": request_id})
    row = found.mappings().first()
    if row is None:
        return None
    attempts = await connection.execute(
        text("SELECT * FROM request_attempts WHERE request_id = :id ORDER BY attempt"), {"id": request_id}
    )
    rows = [{key: value for key, value in attempt.items() if key != "request_id"} for attempt in attempts.mappings()]
    trace = await connection.execute(
        text(
            "SELECT body->>'trace_id' FROM request_events"
            " WHERE request_id = :id AND type = 'RequestAccepted' ORDER BY version LIMIT 1"
        ),
        {"id": request_id},
    )
    return RequestSummary(dict(row), rows, trace.scalar_one_or_none())


async def request_tenant(connection: AsyncConnection, request_id: str) -> str | None:
    """The tenant whose request ``request_id`` is, or ``None`` when the log has no such request:
    its ``RequestAccepted``'s, from the log, never from a read model that may trail it (docs/design.md §8)."""
    found = await connection.execute(
        text("SELECT body->>'tenant' FROM request_events WHERE request_id = :id AND version = 1 LIMIT 1"),
        {"id": request_id},
    )
    tenant: str | None = found.scalar_one_or_none()
    return tenant
