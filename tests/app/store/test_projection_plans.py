"""The projection trigger finds the read-model rows it updates by key, whatever the
tables held when its plans were made (migration 0009).

The trigger's plans are generic and kept per connection (0007), made at a
connection's first append, and made again when a table's statistics change. A
connection that makes them on an empty log, with a first batch of many events (a
gateway's writer at its first group commit), or on a day's first rows once ANALYZE
has seen them (autovacuum does, a minute in), must still look rows up by key once the
day holds many: a plan that reads the whole partition costs each batch more as the
day grows. auto_explain, sent to this client, shows the plan
each statement of the trigger ran.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable, Iterable
from datetime import UTC, datetime, time

import asyncpg
import pytest

from app.store.codec import EventRow, to_row
from app.store.database import asyncpg_dsn
from app.store.insert import LogSchema, insert_rows
from ops import traces

# a read model's partition, read whole
WHOLE_READ = re.compile(r"Seq Scan on (requests|request_attempts)\w*")
BY_KEY = re.compile(r"Index (Only )?Scan using \w+ on (requests|request_attempts)\w*")


def rows(trace: traces.Trace) -> list[EventRow]:
    day = to_row(trace.events[0]).accepted_on
    return [to_row(event, day) for event in trace.events]


def requests_of_every_kind(prefix: str, requests: int, at: datetime) -> Iterable[traces.Trace]:
    """Requests of every kind the projection's attempt statements see: first tokens,
    failures, fences, cancels, releases and completions, accepted ``at``."""
    kinds: list[Callable[..., traces.Trace]] = [traces.completed, traces.retried_before_first_delta]
    kinds += [traces.fenced_then_retried, traces.cancelled_by_client]
    return (kinds[number % len(kinds)](f"{prefix}_{number}", at=at) for number in range(requests))


@pytest.fixture
async def connection(database_url: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        try:
            await conn.execute("LOAD 'auto_explain'")
        except asyncpg.PostgresError as exc:
            pytest.skip(f"auto_explain is not available on this server: {exc}")
        await conn.execute("SET auto_explain.log_min_duration = 0; SET auto_explain.log_nested_statements = on")
        yield conn
    finally:
        await conn.close()


async def plans_of(conn: asyncpg.Connection, batch: list[EventRow], schema: LogSchema) -> list[str]:
    """The plans of the statements one append ran, the trigger's included."""
    messages: list[str] = []

    def listen(_: object, message: asyncpg.PostgresLogMessage) -> None:
        messages.append(str(message))

    conn.add_log_listener(listen)
    await conn.execute("SET client_min_messages = log")
    try:
        await insert_rows(conn, batch, copy=len(batch) > 1, schema=schema)
    finally:
        await conn.execute("SET client_min_messages = notice")
        conn.remove_log_listener(listen)
    return messages


@pytest.mark.parametrize("through", ["parent", "day"])
@pytest.mark.parametrize(
    ("first_requests", "analyzed_small"),
    [(40, False), (1, True), (40, True), (100, True)],
    ids=["empty", "analyzed-at-1", "analyzed-at-40", "analyzed-at-100"],
)
async def test_the_projection_looks_rows_up_by_key_whatever_the_tables_held_when_planned(
    connection: asyncpg.Connection, first_requests: int, analyzed_small: bool, through: str
) -> None:
    """``through``: the parent's triggers (a day in the legacy partition), or a day's own (0010)."""
    schema = LogSchema()
    await schema.learn(connection)
    at = traces.T0
    if through == "day":
        at = datetime.combine(min(schema.days), time(12), tzinfo=UTC)

    def scenario(prefix: str, requests: int) -> Iterable[traces.Trace]:
        return requests_of_every_kind(prefix, requests, at)

    # the plans are made now: on empty tables, for a first batch of that many requests' events
    first = [row for trace in scenario("req_first", first_requests) for row in rows(trace)]
    await insert_rows(connection, first, copy=True, schema=schema)
    if analyzed_small:  # as autovacuum does at a day's first rows: the plans are made again, on them
        await connection.execute("ANALYZE requests, request_attempts")
        for trace in scenario("req_second", 2):  # a few events at a time, as a gateway appends them
            second = rows(trace)
            for start in range(0, len(second), 2):
                await insert_rows(connection, second[start : start + 2], copy=False, schema=schema)
    for start in range(0, 400, 20):  # the day grows
        grown = [row for trace in scenario(f"req_grown_{start}", 20) for row in rows(trace)]
        await insert_rows(connection, grown, copy=True, schema=schema)

    batch = [row for trace in scenario("req_last", 8) for row in rows(trace)]
    plans = "\n".join(await plans_of(connection, batch, schema))
    # the statements ran, and were explained
    assert re.search(r"UPDATE request_attempts\w* a SET completed_at", plans)
    assert re.search(r"UPDATE request_attempts\w* a SET\n", plans) and re.search(r"UPDATE requests\w* r SET", plans)
    assert (through == "day") == (f"request_attempts_p{at:%Y%m%d} a SET" in plans)
    assert not WHOLE_READ.findall(plans), plans
    assert {match.group(2) for match in BY_KEY.finditer(plans)} == {"requests", "request_attempts"}

    # a batch of deliveries only: the narrow update of requests
    trace = traces.completed("req_deliveries", texts=("a", "b", "c", "d"), at=at)
    await insert_rows(connection, rows(trace)[:-3], copy=False, schema=schema)
    deliveries = rows(trace)[-3:-1]
    assert {row.type for row in deliveries} == {"DeltasDelivered"}
    plans = "\n".join(await plans_of(connection, deliveries, schema))
    assert re.search(r"UPDATE requests\w* r SET", plans)
    assert not WHOLE_READ.findall(plans), plans
    assert BY_KEY.search(plans), plans
