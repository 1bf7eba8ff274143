"""``shielded``: work a cancelled caller must not stop (app/driver/shielded.py), on its
own and as the recorder's appends use it, against real PostgreSQL; and ``begun``, the
same work started without waiting for it."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import asyncpg
import pytest

from app.config import GatewayConfig
from app.driver.budget import RetryBudget
from app.driver.context import GatewayContext
from app.driver.recorder import Recorder
from app.driver.shielded import begun, shielded
from app.replicas.pool import ReplicaPool
from app.store.database import asyncpg_dsn
from app.store.postgres import PostgresEventStore
from app.telemetry.metrics import Metrics
from ops import traces
from statemachine import events as ev
from statemachine.state import fold


async def test_work_that_never_suspends_runs_in_the_callers_task() -> None:
    ran_in: list[asyncio.Task[Any] | None] = []

    async def work() -> int:
        ran_in.append(asyncio.current_task())
        return 7

    before = len(asyncio.all_tasks())
    assert await shielded(work()) == 7
    assert ran_in == [asyncio.current_task()] and len(asyncio.all_tasks()) == before


async def test_work_that_suspends_goes_on_when_its_caller_is_cancelled() -> None:
    gate = asyncio.get_running_loop().create_future()
    steps: list[str] = []

    async def work() -> str:
        steps.append("began")
        await gate
        await asyncio.sleep(0)  # a bare yield too
        steps.append("ended")
        return "done"

    caller = asyncio.create_task(shielded(work()))
    await asyncio.sleep(0.01)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert steps == ["began"]
    gate.set_result(None)
    for _ in range(5):
        await asyncio.sleep(0)
    assert steps == ["began", "ended"]


async def test_what_the_awaited_future_raises_reaches_the_work_and_what_the_work_raises_the_caller() -> None:
    gate = asyncio.get_running_loop().create_future()

    async def work() -> str:
        try:
            await gate
        except KeyError:
            raise ValueError("seen") from None
        return "unreachable"

    asyncio.get_running_loop().call_later(0.01, gate.set_exception, KeyError("x"))
    with pytest.raises(ValueError, match="seen"):
        await shielded(work())


async def test_begun_work_runs_its_first_step_now_and_the_rest_while_the_caller_goes_on() -> None:
    gate = asyncio.get_running_loop().create_future()
    steps: list[str] = []

    async def work() -> str:
        steps.append("began")
        await gate
        steps.append("ended")
        return "done"

    future = begun(work())
    assert steps == ["began"] and not future.done()  # the first step ran in this step

    async def wait() -> str:
        return await asyncio.shield(future)

    waiter = asyncio.create_task(wait())
    await asyncio.sleep(0.01)
    waiter.cancel()  # a waiter that gives up leaves the work running
    with pytest.raises(asyncio.CancelledError):
        await waiter
    gate.set_result(None)
    assert await future == "done" and steps == ["began", "ended"]


async def test_begun_work_that_never_suspends_is_done_at_once_in_the_callers_task() -> None:
    async def work() -> int:
        return 7

    async def fails() -> int:
        raise KeyError("first step")

    before = len(asyncio.all_tasks())
    done, failed = begun(work()), begun(fails())
    assert len(asyncio.all_tasks()) == before and done.done() and failed.done()
    assert done.result() == 7
    with pytest.raises(KeyError, match="first step"):
        failed.result()


def context(store: PostgresEventStore) -> GatewayContext:
    return GatewayContext(
        config=GatewayConfig(),
        store=store,
        pool=ReplicaPool([]),
        budget=RetryBudget(10, 1.0),
        metrics=Metrics(),
        gateway_id="gw_test",
    )


def again(recorder: Recorder, event: ev.Event) -> None:
    """Record ``event``'s body through ``recorder`` (stamped anew)."""
    fields = {f.name: getattr(event, f.name) for f in dataclasses.fields(event)}
    for stamp in ("request_id", "seq", "occurred_at"):
        del fields[stamp]
    recorder.record(type(event), **fields)


async def test_a_durable_flush_whose_caller_left_mid_append_is_appended_and_counted(
    event_store: PostgresEventStore, database_url: str
) -> None:
    trace = traces.completed("req_left")
    await event_store.append("req_left", 0, trace.events[:3])
    recorder = Recorder(context(event_store), fold(trace.events[:3]))
    blocker = await asyncpg.connect(asyncpg_dsn(database_url))
    transaction = blocker.transaction()
    await transaction.start()
    await blocker.execute("SELECT * FROM requests WHERE request_id = 'req_left' FOR UPDATE")  # stalls the write
    again(recorder, trace.events[3])
    commit = asyncio.create_task(recorder.flush(durable=True))
    await asyncio.sleep(0.2)
    commit.cancel()  # the client went away while the commit point was being appended
    with pytest.raises(asyncio.CancelledError):
        await commit
    await transaction.rollback()
    await blocker.close()
    await event_store.flush()
    await asyncio.sleep(0.01)
    assert recorder.appended_version == 4 and not recorder.has_unflushed  # its append went on, and counted
    for event in trace.events[4:]:
        again(recorder, event)
    await recorder.flush(durable=True)  # after the first: no conflict, nothing appended twice
    assert [(e.seq, type(e)) for e in await event_store.read("req_left")] == [(e.seq, type(e)) for e in trace.events]
