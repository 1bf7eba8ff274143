"""The sweep of a lapsed instance on real PostgreSQL: it never leaves a request open.

The sweeper reads each open request from the log and then appends its close. Events
may land in between: its own store's queue (appends kept through an outage, written
under the instance's new lease), or another instance closing the request too. The
closing append then collides (``StreamConflict``); the sweep reads the log again and
closes from there (app/driver/recovery.py: close_from_log). A close that fails
anyway (the log away) leaves the lapsed instance unswept, and the next sweep closes
what is still open.
"""

from __future__ import annotations

import asyncio
import dataclasses

from app.config import GatewayConfig, Timeouts
from app.driver.budget import RetryBudget
from app.driver.context import GatewayContext
from app.driver.instance import GatewayInstance
from app.replicas.pool import ReplicaPool
from app.store.errors import StoreUnavailable
from app.store.instances import InstanceInfo, InstanceRegistry
from app.store.postgres import PostgresEventStore
from app.telemetry.metrics import Metrics
from ops import traces
from statemachine import events as ev
from statemachine.phases import Phase
from statemachine.state import fold


def info(instance_id: str) -> InstanceInfo:
    return InstanceInfo(instance_id, f"{instance_id}:8000", "host", 1, "test", None)


def sweeper_context(store: PostgresEventStore, instance_id: str) -> GatewayContext:
    return GatewayContext(
        config=GatewayConfig(timeouts=Timeouts(lease_ttl_s=0.05)),  # the lost attempt's lease
        store=store,
        pool=ReplicaPool([]),
        budget=RetryBudget(10, 1.0),
        metrics=Metrics(),
        gateway_id=instance_id,
    )


async def open_request_of_lapsed_instance(store: PostgresEventStore, request_id: str) -> list[ev.Event]:
    """``request_id`` accepted by ``gw_dead``, its attempt started, when ``gw_dead``
    lapses; ``gw_sweeper`` is live and the store appends for it."""
    registry = InstanceRegistry(store)
    await registry.register(info("gw_dead"), ttl_s=0.01)
    await registry.register(info("gw_sweeper"), ttl_s=30.0)
    trace = traces.completed(request_id)
    opened = [dataclasses.replace(trace.events[0], gateway="gw_dead"), *trace.events[1:3]]
    await store.append(request_id, 0, opened)
    store.writer.bind_instance("gw_sweeper")
    await asyncio.sleep(0.05)  # gw_dead lapses
    return opened


async def test_a_sweep_whose_close_collides_reads_the_log_again(event_store: PostgresEventStore) -> None:
    opened = await open_request_of_lapsed_instance(event_store, "req_swept")
    trace = traces.completed("req_swept")

    # Right after the sweeper's read, an append of the request is still to land (it
    # joins the writer's queue ahead of the close): the log the close starts from is short.
    read = event_store.read
    reads = 0

    async def read_then_land_one_more(request_id: str) -> list[ev.Event]:
        nonlocal reads
        events = await read(request_id)
        reads += 1
        if reads == 1:
            await event_store.append(request_id, len(events), trace.events[3:4], durable=False)
        return events

    event_store.read = read_then_land_one_more  # type: ignore[method-assign]
    sweeper = GatewayInstance(sweeper_context(event_store, "gw_sweeper"), event_store)
    assert await sweeper.sweep() == 1
    event_store.read = read  # type: ignore[method-assign]

    events = await event_store.read("req_swept")
    assert events[:4] == [*opened, trace.events[3]]  # what landed after the first read is kept
    state = fold(events)
    assert state.phase is Phase.TERMINATED, [type(event).__name__ for event in events]
    (failed,) = [event for event in events if isinstance(event, ev.RequestFailed)]
    assert failed.code == "gateway_lost"
    assert reads == 2


async def test_a_sweep_that_left_a_request_open_goes_back_to_it(event_store: PostgresEventStore) -> None:
    await open_request_of_lapsed_instance(event_store, "req_reswept")
    read = event_store.read
    reads = 0

    async def read_the_log_away_once(request_id: str) -> list[ev.Event]:
        nonlocal reads
        reads += 1
        if reads == 1:
            raise StoreUnavailable("PostgreSQL is unreachable (for this test)")
        return await read(request_id)

    event_store.read = read_the_log_away_once  # type: ignore[method-assign]
    sweeper = GatewayInstance(sweeper_context(event_store, "gw_sweeper"), event_store)
    assert await sweeper.sweep() == 0  # the close failed: gw_dead is not swept
    rows = {row["instance_id"]: row for row in await InstanceRegistry(event_store).recent()}
    assert rows["gw_dead"]["swept_by"] == "gw_sweeper" and rows["gw_dead"]["swept_at"] is None
    assert await sweeper.sweep() == 1  # still its claim: the next sweep closes the request
    event_store.read = read  # type: ignore[method-assign]

    assert fold(await event_store.read("req_reswept")).phase is Phase.TERMINATED
    rows = {row["instance_id"]: row for row in await InstanceRegistry(event_store).recent()}
    assert rows["gw_dead"]["swept_at"] is not None and rows["gw_dead"]["requests_swept"] == 1


async def test_an_instance_that_registers_again_takes_its_old_id_over(event_store: PostgresEventStore) -> None:
    """Fenced, an instance registers under a new id and claims its old one in the same
    transaction: only that process knows what the old id's clients were told, so no other
    instance sweeps it; a take-over a live sweeper already holds is left to that sweeper."""
    registry = InstanceRegistry(event_store)
    await registry.register(info("gw_old"), ttl_s=0.01)
    await registry.register(info("gw_other"), ttl_s=30.0)
    await asyncio.sleep(0.05)  # gw_old lapses
    assert await registry.register(info("gw_new"), ttl_s=30.0, taking_over="gw_old") is True
    assert await registry.claim_lapsed("gw_other") == []
    rows = {row["instance_id"]: row for row in await registry.recent()}
    assert rows["gw_old"]["swept_by"] == "gw_new" and not rows["gw_old"]["live"]

    await registry.register(info("gw_gone"), ttl_s=0.01)
    await asyncio.sleep(0.05)
    assert await registry.claim_lapsed("gw_other") == ["gw_gone"]
    assert await registry.register(info("gw_back"), ttl_s=30.0, taking_over="gw_gone") is False
    rows = {row["instance_id"]: row for row in await registry.recent()}
    assert rows["gw_gone"]["swept_by"] == "gw_other"


@dataclasses.dataclass
class ToldItsClient:
    """What the sweep reads of a request this process still holds (a ``RequestDriver``
    whose log was lost): the final error its client was told."""

    request_id: str
    told: tuple[str, str] | None


async def test_a_sweep_closes_a_request_with_the_error_its_own_process_told(event_store: PostgresEventStore) -> None:
    await open_request_of_lapsed_instance(event_store, "req_told")
    context = sweeper_context(event_store, "gw_sweeper")
    told = ("event_log_unavailable", "the request log became unavailable; the answer stops here")
    context.drivers["req_told"] = ToldItsClient("req_told", told)  # type: ignore[assignment]
    assert await GatewayInstance(context, event_store).sweep() == 1

    (failed,) = [event for event in await event_store.read("req_told") if isinstance(event, ev.RequestFailed)]
    assert (failed.code, failed.partial_output) == ("event_log_unavailable", False)


async def test_sweeps_wait_one_lease_after_the_log_was_away(event_store: PostgresEventStore) -> None:
    """A sweep that found the log away holds the sweeps for one lease TTL: an instance cut
    off by the same outage comes back first and closes its own requests."""
    await open_request_of_lapsed_instance(event_store, "req_held")
    context = sweeper_context(event_store, "gw_sweeper")
    ttl_s = 1.0
    context.config = dataclasses.replace(context.config, instance_lease_ttl_s=ttl_s, sweep_interval_s=0.02)
    sweeper = GatewayInstance(context, event_store)
    claim = sweeper.registry.claim_lapsed
    failed_at: list[float] = []

    async def away_once(instance_id: str, limit: int = 8) -> list[str]:
        if not failed_at:
            failed_at.append(context.clock())
            raise StoreUnavailable("PostgreSQL is unreachable (for this test)")
        return await claim(instance_id, limit)

    sweeper.registry.claim_lapsed = away_once  # type: ignore[method-assign]
    sweeps = asyncio.get_running_loop().create_task(sweeper._sweeps())
    try:
        await asyncio.sleep(ttl_s / 2)
        assert failed_at and fold(await event_store.read("req_held")).phase is not Phase.TERMINATED
        while fold(await event_store.read("req_held")).phase is not Phase.TERMINATED:
            assert context.clock() < failed_at[0] + ttl_s + 5, "the held sweeps never came back"
            await asyncio.sleep(0.05)
        assert context.clock() >= failed_at[0] + ttl_s
    finally:
        sweeps.cancel()
        await asyncio.gather(sweeps, return_exceptions=True)
