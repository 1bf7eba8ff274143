"""The group-commit writer on real PostgreSQL: delay, ordering, back-pressure, failures."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import asyncpg
import pytest

from app.store import PostgresEventStore, StoreError, StreamConflict
from app.store.database import asyncpg_dsn
from app.store.insert import COPY_FROM
from ops import traces
from statemachine.events import DeltasDelivered
from tests.app.store.contract import other_delivery
from tests.support.waiting import until

StoreFactory = Callable[..., Awaitable[PostgresEventStore]]


@pytest.fixture
async def open_store(database_url: str) -> AsyncIterator[StoreFactory]:
    """Open stores with the options a test needs; all are closed after it."""
    opened: list[PostgresEventStore] = []

    async def open_(**options: object) -> PostgresEventStore:
        store = await PostgresEventStore.connect(database_url, **options)
        opened.append(store)
        return store

    yield open_
    for store in opened:
        await store.close()


async def visible(database_url: str, request_id: str) -> int:
    connection = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        count = await connection.fetchval("SELECT count(*) FROM request_events WHERE request_id = $1", request_id)
        return int(count)
    finally:
        await connection.close()


def test_the_default_flush_delay_is_at_most_ten_milliseconds() -> None:
    default = inspect.signature(PostgresEventStore).parameters["flush_delay"].default
    assert 0 < default <= 0.010


async def test_queued_appends_are_committed_within_the_flush_delay(open_store: StoreFactory, database_url: str) -> None:
    store = await open_store(flush_delay=0.2)
    trace = traces.completed("req_delay")
    began = time.monotonic()
    await store.append("req_delay", 0, trace.events[:3], durable=False)
    assert await visible(database_url, "req_delay") == 0  # lingering for company
    while await visible(database_url, "req_delay") == 0:
        await asyncio.sleep(0.01)
    assert 0.19 <= time.monotonic() - began < 0.2 + 1.0


async def test_many_requests_share_one_commit(open_store: StoreFactory) -> None:
    store = await open_store(flush_delay=0.05)
    scenario = [traces.completed(f"req_{number}") for number in range(50)]
    before = store.writer.batches
    for seq in range(len(scenario[0].events)):
        for trace in scenario:
            await store.append(trace.request_id, seq, [trace.events[seq]], durable=False)
    await store.flush()
    assert store.writer.batches - before == 1
    for trace in scenario[::10]:
        assert await store.read(trace.request_id) == trace.events


async def test_a_durable_append_does_not_wait_for_the_flush_delay(open_store: StoreFactory) -> None:
    store = await open_store(flush_delay=5.0)
    queued, durable = traces.completed("req_queued"), traces.completed("req_durable")
    await store.append("req_queued", 0, queued.events, durable=False)
    began = time.monotonic()
    await store.append("req_durable", 0, durable.events)
    assert time.monotonic() - began < 2.0
    assert await store.read("req_queued") == queued.events  # it was ahead in the pipeline


async def test_close_commits_every_accepted_append(open_store: StoreFactory, database_url: str) -> None:
    store = await open_store(flush_delay=60.0)
    scenario = [traces.retried_before_first_delta(f"req_{number}") for number in range(5)]
    for trace in scenario:
        for seq, event in enumerate(trace.events):
            await store.append(trace.request_id, seq, [event], durable=False)
    await store.close()
    reader = await open_store()
    for trace in scenario:
        assert await reader.read(trace.request_id) == trace.events


async def test_appends_wait_for_room_while_postgresql_is_slow(open_store: StoreFactory, database_url: str) -> None:
    store = await open_store(max_queued_events=8, flush_delay=0.001)
    trace = traces.completed("req_slow", texts=tuple(str(n) for n in range(40)))
    await store.append("req_slow", 0, trace.events[:5])
    blocker = await asyncpg.connect(asyncpg_dsn(database_url))
    transaction = blocker.transaction()
    await transaction.start()
    await blocker.execute("SELECT * FROM requests WHERE request_id = 'req_slow' FOR UPDATE")  # stalls the trigger

    async def deliver() -> None:
        for seq in range(5, len(trace.events)):
            await store.append("req_slow", seq, [trace.events[seq]], durable=False)

    producer = asyncio.create_task(deliver())
    await asyncio.sleep(0.3)
    assert not producer.done()  # held back: the queue is full and PostgreSQL does not move
    assert store.writer.queued_events <= 8
    await transaction.rollback()
    await blocker.close()
    await asyncio.wait_for(producer, 10)
    await store.flush()
    assert await store.read("req_slow") == trace.events


@pytest.mark.parametrize("requests", [2, 14], ids=["insert", "copy"])
async def test_a_conflict_fails_only_its_own_appends(open_store: StoreFactory, requests: int) -> None:
    store, rival = await open_store(flush_delay=0.05), await open_store()
    scenario = [traces.completed(f"req_{number}", texts=("a", "b", "c", "d")) for number in range(requests)]
    for trace in scenario:
        await store.append(trace.request_id, 0, trace.events[:5])
    victim = scenario[-1]
    await rival.append(victim.request_id, 5, [other_delivery(victim, 6)])
    queued = 0
    for trace in scenario:  # one batch: nothing yields between these appends
        for seq in range(5, len(trace.events)):
            await store.append(trace.request_id, seq, [trace.events[seq]], durable=False)
            queued += 1
    assert (queued >= COPY_FROM) == (requests == 14)
    await store.flush()
    for trace in scenario[:-1]:
        assert await store.read(trace.request_id) == trace.events
    assert await store.read(victim.request_id) == [*victim.events[:5], other_delivery(victim, 6)]
    with pytest.raises(StreamConflict):  # told once, at the victim's next append
        await store.append(victim.request_id, 6, [victim.events[6]])


async def test_a_batch_that_repeats_recorded_events_writes_only_the_new_ones(
    open_store: StoreFactory,
) -> None:
    store = await open_store(flush_delay=0.05)
    recorded = [traces.completed(f"req_old_{number}") for number in range(10)]
    new = [traces.completed(f"req_new_{number}") for number in range(10)]
    for trace in recorded:
        await store.append(trace.request_id, 0, trace.events)
    for trace in [*recorded, *new]:  # a retry of recorded events, in a COPY-sized batch
        await store.append(trace.request_id, 0, trace.events, durable=False)
    await store.flush()
    for trace in [*recorded, *new]:
        assert await store.read(trace.request_id) == trace.events
    continued = traces.completed("req_old_0")
    assert await store.append("req_old_0", len(continued.events), [other_delivery(continued, 10)]) == 10


async def test_two_stores_racing_for_the_same_versions(open_store: StoreFactory) -> None:
    first, second = await open_store(), await open_store()
    scenario = [traces.completed(f"req_{number}") for number in range(20)]
    for trace in scenario:
        await first.append(trace.request_id, 0, trace.events[:5])
    results = await asyncio.gather(
        *(first.append(trace.request_id, 5, [trace.events[5]]) for trace in scenario),
        *(second.append(trace.request_id, 5, [other_delivery(trace, 6)]) for trace in scenario),
        return_exceptions=True,
    )
    ours, theirs = results[: len(scenario)], results[len(scenario) :]
    for trace, mine, rival in zip(scenario, ours, theirs, strict=True):
        assert {type(mine).__name__, type(rival).__name__} == {"int", "StreamConflict"}
        winner = trace.events[5] if mine == 6 else other_delivery(trace, 6)
        assert await first.read(trace.request_id) == [*trace.events[:5], winner]


async def test_a_row_postgresql_cannot_take_fails_its_own_append_only(open_store: StoreFactory) -> None:
    store = await open_store(flush_delay=0.05)
    fine = traces.completed("req_fine")
    huge = DeltasDelivered("req_huge", 2**31, traces.T0, 1, 1, 0, 1, 1, "x", None)  # no int4 holds it
    await store.append("req_fine", 0, fine.events[:4], durable=False)
    with pytest.raises(StoreError):
        await store.append("req_huge", 2**31 - 1, [huge])
    await store.append("req_fine", 4, fine.events[4:])
    assert await store.read("req_fine") == fine.events


async def test_a_cancelled_durable_append_is_still_written_in_order(
    open_store: StoreFactory, database_url: str
) -> None:
    store = await open_store(flush_delay=0.05)
    trace = traces.completed("req_cancelled")
    blocker = await asyncpg.connect(asyncpg_dsn(database_url))
    transaction = blocker.transaction()
    await transaction.start()
    await store.append("req_cancelled", 0, trace.events[:3])
    await blocker.execute("SELECT * FROM requests WHERE request_id = 'req_cancelled' FOR UPDATE")  # stalls the write
    waiting = asyncio.create_task(store.append("req_cancelled", 3, [trace.events[3]]))
    await asyncio.sleep(0.2)
    waiting.cancel()  # the client went away while its durable append was being written
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await store.append("req_cancelled", 4, trace.events[4:], durable=False)  # continues after it
    await transaction.rollback()
    await blocker.close()
    await store.flush()
    assert await store.read("req_cancelled") == trace.events


async def test_a_batch_holds_at_most_max_batch_events(open_store: StoreFactory) -> None:
    store = await open_store(flush_delay=0.05, max_batch_events=100)
    scenario = [traces.completed(f"req_{number}", texts=tuple("abcdefghij")) for number in range(30)]
    before = store.writer.batches
    for trace in scenario:  # one append per request, queued without yielding
        await store.append(trace.request_id, 0, trace.events, durable=False)
    await store.flush()
    events = sum(len(trace.events) for trace in scenario)
    assert store.writer.batches - before >= events // 100
    for trace in scenario[::7]:
        assert await store.read(trace.request_id) == trace.events


async def test_an_append_queued_in_the_callers_step_settles_at_its_commit(
    open_store: StoreFactory, database_url: str
) -> None:
    # A batch lingers for company until a flush ends the wait: no timer decides what is seen.
    store = await open_store(max_queued_events=8, flush_delay=60)
    trace = traces.completed("req_now", texts=tuple(str(n) for n in range(12)))
    await store.append("req_now", 0, trace.events[:5])
    committed = store.append_grouped_now("req_now", 5, trace.events[5:7])
    assert committed is not None
    assert store.writer.queued_events == 2  # queued in this step, with no await between
    assert await visible(database_url, "req_now") == 5 and not committed.done()
    await asyncio.wait_for(store.flush(), 10)
    assert committed.done()
    await committed
    assert await store.read("req_now") == trace.events[:7]

    blocker = await asyncpg.connect(asyncpg_dsn(database_url))
    transaction = blocker.transaction()
    await transaction.start()
    await blocker.execute("SELECT * FROM requests WHERE request_id = 'req_now' FOR UPDATE")  # stalls the trigger
    try:
        first = store.append_grouped_now("req_now", 7, trace.events[7:9])
        assert first is not None
        flushing = asyncio.create_task(store.flush())
        await until(lambda: store.writer.queued_events == 0)  # taken into a transaction that waits on the lock
        assert not flushing.done()
        second = store.append_grouped_now("req_now", 9, trace.events[9:15])
        assert second is not None and store.writer.queued_events == 6
        assert store.append_grouped_now("req_now", 15, trace.events[15:18]) is None  # nine: no room in eight
        assert store.writer.queued_events == 6  # nothing queued by the refusal
    finally:
        await transaction.rollback()
        await blocker.close()
    await asyncio.wait_for(asyncio.gather(flushing, store.flush()), 10)
    await asyncio.gather(first, second)
    assert await store.read("req_now") == trace.events[:15]


async def test_a_conflict_of_an_append_queued_in_step_settles_its_future(open_store: StoreFactory) -> None:
    store, rival = await open_store(flush_delay=0.01), await open_store()
    trace = traces.completed("req_now_conflict", texts=("a", "b", "c"))
    await store.append(trace.request_id, 0, trace.events[:5])
    await rival.append(trace.request_id, 5, [other_delivery(trace, 6)])
    committed = store.append_grouped_now(trace.request_id, 5, trace.events[5:6])
    assert committed is not None
    with pytest.raises(StreamConflict):
        await asyncio.wait_for(committed, 10)
    assert await store.read(trace.request_id) == [*trace.events[:5], other_delivery(trace, 6)]
