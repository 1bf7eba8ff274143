"""Following the log on PostgreSQL: nothing missed when commits overtake each other."""

from __future__ import annotations

import asyncio
import contextlib
import random

import asyncpg

from app.store import PostgresEventStore
from app.store.codec import to_row
from app.store.database import asyncpg_dsn
from app.store.insert import INSERT_EVENTS, columns
from ops import traces
from statemachine.events import Event
from tests.app.store.contract import collect


async def test_an_event_committed_after_later_positions_is_not_missed(
    event_store: PostgresEventStore, database_url: str
) -> None:
    slow = traces.completed("req_slow")
    fast = traces.completed("req_fast")
    other_writer = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        transaction = other_writer.transaction()
        await transaction.start()
        await other_writer.execute(INSERT_EVENTS, *columns([to_row(slow.events[0])]))  # takes a position
        await event_store.append("req_fast", 0, fast.events)  # later positions, committed first
        follower = asyncio.create_task(collect(event_store, 0, 1 + len(fast.events)))
        await asyncio.sleep(0.3)
        assert not follower.done()  # the open transaction holds the horizon back
        await transaction.commit()
        seen = await follower
    finally:
        await other_writer.close()
    positions = [position for position, _ in seen]
    assert len(set(positions)) == len(positions) == 1 + len(fast.events)
    slow_position = next(position for position, event in seen if event.request_id == "req_slow")
    assert slow_position < min(position for position, event in seen if event.request_id == "req_fast")
    assert [event for _, event in seen if event.request_id == "req_fast"] == fast.events


async def test_followers_see_every_event_once_while_writers_overlap(database_url: str) -> None:
    writers = [await PostgresEventStore.connect(database_url, flush_delay=0.001) for _ in range(4)]
    followers: list[list[tuple[int, Event]]] = [[], []]
    scenario = [traces.retried_before_first_delta(f"req_{number}") for number in range(40)]
    total = sum(len(trace.events) for trace in scenario)
    shuffle = random.Random(7)

    async def write(store: PostgresEventStore, mine: list[traces.Trace]) -> None:
        for trace in mine:
            seq = 0
            while seq < len(trace.events):
                size = shuffle.randint(1, 4)
                await store.append(trace.request_id, seq, trace.events[seq : seq + size], durable=size % 2 == 0)
                seq += size
                await asyncio.sleep(0)

    async def follow(seen: list[tuple[int, Event]]) -> None:
        async with contextlib.aclosing(writers[0].follow()) as stream:
            async for item in stream:
                seen.append(item)
                if len(seen) == total:
                    return

    try:
        reading = [asyncio.create_task(follow(seen)) for seen in followers]
        await asyncio.gather(*(write(store, scenario[index::4]) for index, store in enumerate(writers)))
        for store in writers:
            await store.flush()
        await asyncio.wait_for(asyncio.gather(*reading), 20)
    finally:
        for store in writers:
            await store.close()
    connection = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        recorded = {row[0] for row in await connection.fetch("SELECT position FROM request_events")}
    finally:
        await connection.close()
    for seen in followers:
        positions = [position for position, _ in seen]
        assert len(positions) == len(set(positions)) == total
        assert set(positions) == recorded
        for trace in scenario:
            assert [event for _, event in seen if event.request_id == trace.request_id] == trace.events


async def test_a_follower_ends_when_its_store_closes(database_url: str) -> None:
    store = await PostgresEventStore.connect(database_url, poll_interval=0.02)
    await store.append("req_end", 0, traces.completed("req_end").events[:2])
    seen = []

    async def follow() -> None:
        async for item in store.follow():
            seen.append(item)

    follower = asyncio.create_task(follow())
    await asyncio.sleep(0.1)
    await store.close()
    await asyncio.wait_for(follower, 5)
    assert len(seen) == 2
