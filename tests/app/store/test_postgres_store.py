"""The PostgreSQL event store: the contract, then what only PostgreSQL can show."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import asyncpg
import pytest

from app.store import EventStore, PostgresEventStore
from app.store.content import Erased, erase_one_request
from app.store.database import asyncpg_dsn
from ops import traces
from statemachine.events import DeltasDelivered, RequestCompleted
from tests.app.store.contract import EventStoreContract


class TestPostgresEventStore(EventStoreContract):
    @pytest.fixture
    async def store(self, event_store: PostgresEventStore) -> AsyncIterator[EventStore]:
        yield event_store


async def test_text_holding_u0000_is_recorded_and_the_stream_goes_on(event_store: PostgresEventStore) -> None:
    trace = traces.completed("req_nul", texts=("a\x00b", "c"))  # a byte-level tokenizer's byte 0
    for seq, event in enumerate(trace.events):
        await event_store.append("req_nul", seq, [event], durable=False)
    await event_store.flush()
    recorded = await event_store.read("req_nul")
    assert len(recorded) == len(trace.events) and isinstance(recorded[-1], RequestCompleted)
    texts = [event.text for event in recorded if isinstance(event, DeltasDelivered)]
    assert texts == ["a\N{REPLACEMENT CHARACTER}b", "c"]


async def test_tool_calls_and_results_holding_u0000_are_kept(event_store: PostgresEventStore) -> None:
    assert await event_store.claim_tool_execution("req_t:call_1", "req_t", 1, "call_1", "f\x00", '{"a": "\x00"}')
    await event_store.record_tool_result("req_t:call_1", result={"out": "x\x00y"})
    kept = await event_store.tool_execution("req_t:call_1")
    assert kept is not None and kept.status == "succeeded"
    assert (kept.name, kept.arguments) == ("f\N{REPLACEMENT CHARACTER}", '{"a": "\N{REPLACEMENT CHARACTER}"}')
    assert kept.result == {"out": "x\N{REPLACEMENT CHARACTER}y"}


async def test_recorded_inputs_hold_one_pooled_connection_at_a_time(event_store: PostgresEventStore) -> None:
    """Input batches behind a slow write wait for it, and grow, instead of taking a pooled
    connection each (every flush delay) while the one ahead still writes."""
    locker = await asyncpg.connect(asyncpg_dsn(event_store.url))
    try:
        locked = locker.transaction()
        await locked.start()
        await locker.execute("LOCK TABLE request_inputs IN ACCESS EXCLUSIVE MODE")  # every write waits
        recorded = []
        for wave in range(8):  # 8 batches' worth, each past the flush delay (5 ms)
            recorded += [
                asyncio.create_task(event_store.record_input(f"req_{wave}_{n}", {"model": "m", "n": n}))
                for n in range(3)
            ]
            await asyncio.sleep(0.03)
        waiting = await locker.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%request_inputs%'"
        )
        assert waiting == 1
        await locked.rollback()
        await asyncio.wait_for(asyncio.gather(*recorded), 10)
    finally:
        await locker.close()
    assert all([await event_store.read_input(f"req_{wave}_{n}") for wave in range(8) for n in range(3)])


async def test_one_requests_content_is_erased_from_what_the_log_says_not_its_row(
    event_store: PostgresEventStore,
) -> None:
    """DELETE /v1/responses/{id} erases by the request's RequestAccepted (its tenant, whether
    it ended), never by a read model that may trail the log (docs/design.md §8, docs/read-models.md)."""
    for request_id, trace in (
        ("req_rowless", traces.completed("req_rowless")),
        ("req_open", traces.in_flight("req_open")),
    ):
        await event_store.append(request_id, 0, trace.events)
        await event_store.record_input(request_id, {"model": "tiny-llm", "input": "secret"})
    connection = await asyncpg.connect(asyncpg_dsn(event_store.url))
    try:  # the rows not there (yet)
        assert (
            await connection.execute("DELETE FROM requests WHERE request_id IN ('req_rowless', 'req_open')")
            == "DELETE 2"
        )
    finally:
        await connection.close()
    assert await event_store.erase_request("another-tenant", "req_rowless") == 0
    assert await event_store.read_input("req_rowless") is not None
    assert await event_store.erase_request("acme", "req_rowless") == 1
    assert await event_store.read_input("req_rowless") is None
    delivered = [e for e in await event_store.read("req_rowless") if isinstance(e, DeltasDelivered)]
    assert delivered and all(e.text is None for e in delivered)
    erased = await erase_one_request_counted(event_store, "req_open")
    assert (erased.requests, erased.unfinished) == (1, 1)  # not ended, by the log


async def erase_one_request_counted(store: PostgresEventStore, request_id: str) -> Erased:
    async with store.reading() as connection:
        erased = await erase_one_request(connection, "acme", request_id)
        await connection.commit()
    return erased
