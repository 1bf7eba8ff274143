"""The open delivery batches' deadlines, one timer a gateway (app/driver/batch_ages.py):
on their own, and a request's batch recorded by its age when the stream pauses, against
real PostgreSQL."""

from __future__ import annotations

import asyncio
from typing import Any

from app.config import GatewayConfig
from app.driver.batch_ages import BatchAges
from app.driver.budget import RetryBudget
from app.driver.context import GatewayContext
from app.driver.outputs import Delta
from app.driver.recorder import Recorder
from app.replicas.pool import ReplicaPool
from app.store.postgres import PostgresEventStore
from app.telemetry.metrics import Metrics
from ops.traces import Trace
from statemachine import events as ev
from statemachine.state import fold


async def test_each_batch_ages_at_its_deadline_in_the_order_they_opened() -> None:
    ages, loop = BatchAges(), asyncio.get_running_loop()
    called: list[tuple[str, float]] = []
    due: dict[str, float] = {}
    for name in ("a", "b", "c"):
        due[name] = loop.time() + 0.05
        ages.watch(lambda batch: called.append((batch, loop.time())), name, 0.05)
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)
    assert [name for name, _ in called] == ["a", "b", "c"]
    for name, at in called:
        assert at >= due[name] - 0.002, f"{name} aged {due[name] - at:.4f} s early"  # none before its age
    assert len(ages) == 0
    ages.watch(lambda batch: called.append((batch, loop.time())), "d", 0.01)  # an idle queue arms again
    await asyncio.sleep(0.05)
    assert [name for name, _ in called] == ["a", "b", "c", "d"]


async def test_batches_due_together_age_in_one_firing_and_a_failing_one_stops_none() -> None:
    ages, loop = BatchAges(), asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, context: errors.append(context))
    called: list[str] = []

    def aged(batch: str) -> None:
        called.append(batch)
        if batch == "bad":
            raise RuntimeError("a bug in one request's recorder")

    for name in ("bad", "x", "y"):
        ages.watch(aged, name, 0.01)
    busy_until = loop.time() + 0.03
    while loop.time() < busy_until:  # the loop is busy past every deadline: one firing takes all
        pass
    await asyncio.sleep(0.02)
    assert called == ["bad", "x", "y"] and len(ages) == 0
    assert len(errors) == 1 and isinstance(errors[0]["exception"], RuntimeError)
    loop.set_exception_handler(None)


def test_a_gateway_on_a_new_event_loop_still_gets_its_batches_aged() -> None:
    ages = BatchAges()
    called: list[str] = []

    async def one(name: str, wait_s: float) -> None:
        ages.watch(called.append, name, 0.01)
        await asyncio.sleep(wait_s)

    asyncio.run(one("left on a closed loop", 0.0))  # its loop closes before the deadline
    asyncio.run(one("on the next loop", 0.05))
    assert called == ["left on a closed loop", "on the next loop"]


PAUSE_S = 0.06  # twice the batch age


async def test_a_paused_streams_open_batch_is_recorded_by_its_age(event_store: PostgresEventStore) -> None:
    trace = Trace("req_paused").start("w1").first_token(20.0).first_delta()
    await event_store.append("req_paused", 0, trace.events)
    config = GatewayConfig(delivery_batch_ms=30.0, delivery_batch_tokens=16)
    ctx = GatewayContext(config, event_store, ReplicaPool([]), RetryBudget(10, 1.0), Metrics(), gateway_id="gw_test")
    recorder = Recorder(ctx, fold(trace.events))
    recorder.appending_deliveries = True  # the commit point is in the log
    attempt = recorder.state.current_attempt
    assert attempt is not None

    def logged() -> list[tuple[int, int, str | None]]:
        return [(e.from_index, e.to_index, e.text) for e in events if type(e) is ev.DeltasDelivered]

    for text in ("Hel", "lo"):
        recorder.delivered(attempt.attempt, attempt.lease_epoch, Delta(text))
    await asyncio.sleep(PAUSE_S)  # no delta comes to close the batch
    await event_store.flush()
    events = await event_store.read("req_paused")
    assert logged() == [(0, 2, "Hello")]
    recorder.delivered(attempt.attempt, attempt.lease_epoch, Delta("!"))  # after the pause: a new batch, aged too
    await asyncio.sleep(PAUSE_S)
    await event_store.flush()
    events = await event_store.read("req_paused")
    assert logged() == [(0, 2, "Hello"), (2, 3, "!")]
    assert len(ctx.batch_ages) == 0
