"""This gateway process as an instance in the log (docs/design.md §11).

How this works: ``start`` registers the instance under a new id and binds the
store's writer to it, whose appends PostgreSQL refuses once the lease lapsed. A
heartbeat renews the lease every third of its TTL and learns how many instances
are live (the retry budget's share); it runs on a thread and a connection of its
own (:class:`app.store.lease.LeaseKeeper`), so neither a busy event loop nor a busy
pool delays it, and only while this process's event loop still runs. The lease is
judged on this process's own monotonic clock too: it is valid until the send time
of the last answered renewal plus the TTL, earlier than PostgreSQL's view, so the
instance knows it is fenced before anyone may sweep it. Fenced, it refuses new
requests, ends its streams with the final error ``gateway_lost`` (the code the
sweeper records) and registers again under a new id, taking its old id over in the
same transaction: its own sweep closes what the old id left open, each request with
the final error its client was told (``event_log_unavailable`` for one whose log was
lost, :meth:`LiveRequest.told`), which no other instance could know. A sweeper runs
every ``sweep_interval_s``: it claims lapsed instances and closes their open requests
from the log (``gateway_lost``), cancelling their attempts. It marks a lapsed
instance swept only once none of its requests is left open; until then it goes
back to it each sweep. A sweep that found the log away holds the sweeps for one
lease TTL: an instance cut off by the same outage has that long, once the log is
back, to renew or register again and close its own requests as it told their clients.
``drain`` is SIGTERM's path: refuse new requests, let open
streams run up to ``drain_s``, then end them with ``gateway_draining``, recorded.
Every ``maintain_interval_s`` (and once at start) it maintains the log's day
partitions (:mod:`app.store.partitions`: ahead, retention); the instances take
turns on an advisory lock, and a run another instance holds is skipped.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid
from importlib import metadata

from app.driver.context import GatewayContext
from app.driver.recovery import close_from_log
from app.store.database import asyncpg_dsn
from app.store.errors import StoreUnavailable
from app.store.instances import InstanceInfo, InstanceRegistry
from app.store.lease import LeaseKeeper, Renewal
from app.store.postgres import PostgresEventStore
from app.tasks import ended
from statemachine.phases import Phase

log = logging.getLogger("phasegate.instance")

GATEWAY_LOST = "gateway_lost"
LOST_MESSAGE = "the gateway serving this request lost its place in the log and ended it"
GATEWAY_DRAINING = "gateway_draining"
DRAINING_MESSAGE = "the gateway drained (it is shutting down) and ended this request"


def with_advice(message: str, partial_output: bool) -> str:
    """``message`` (what the gateway did) and what the client may do, as its fields say:
    ``retryable`` is false once part of the answer was sent (docs/design.md §6)."""
    if partial_output:
        return (
            f"{message} after part of the answer was sent; it will not run it again (send a new request to regenerate)"
        )
    return f"{message} before any of the answer was sent; send the request again"


def new_instance_id() -> str:
    return f"gw_{uuid.uuid4().hex[:16]}"


def _version() -> str:
    try:
        return metadata.version("phasegate")
    except metadata.PackageNotFoundError:  # pragma: no cover - run from a source tree
        return "unknown"


class GatewayInstance:
    def __init__(self, ctx: GatewayContext, store: PostgresEventStore, *, address: str | None = None) -> None:
        self.ctx = ctx
        self.store = store
        self.registry = InstanceRegistry(store)
        self.address = address  # where other instances reach this one
        self.valid_until = 0.0  # monotonic: the lease as this process must assume it
        self._tasks: list[asyncio.Task[None]] = []
        self._expiry: asyncio.TimerHandle | None = None
        self._fencing: asyncio.Task[None] | None = None
        self._unswept: set[str] = set()  # lapsed instances claimed with requests left open
        self._sweeps_held_until = 0.0  # monotonic: after an outage, cut-off instances come back first
        self._keeper: LeaseKeeper | None = None

    @property
    def instance_id(self) -> str:
        return self.ctx.gateway_id

    @property
    def ttl_s(self) -> float:
        return self.ctx.config.instance_lease_ttl_s

    async def start(self) -> None:
        """Register (raises if PostgreSQL cannot be reached), make today's partitions,
        then heartbeat, sweep and maintain the partitions."""
        await self._register()
        if self.ctx.config.maintain_interval_s > 0:
            await self.maintain(wait=False)  # skipped: another instance is making them
        self._keeper = LeaseKeeper(asyncpg_dsn(self.store.url), self.ttl_s, self._renewed, clock=self.ctx.clock)
        self._keeper.bind(self.instance_id)
        self._keeper.start()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._sweeps(), name="instance sweeps")]
        if self.ctx.config.maintain_interval_s > 0:
            self._tasks.append(loop.create_task(self._maintenance(), name="partition maintenance"))

    async def _register(self, taking_over: str | None = None) -> None:
        config = self.ctx.config
        instance_id = new_instance_id()
        info = InstanceInfo(
            instance_id=instance_id,
            name=config.instance_name or f"{socket.gethostname()}:{config.port}",
            host=socket.gethostname(),
            pid=os.getpid(),
            version=_version(),
            address=self.address,
        )
        sent_at = self.ctx.clock()
        took_over = await self.registry.register(info, self.ttl_s, taking_over=taking_over)
        self.ctx.gateway_id = instance_id
        # claims of the old id pass to others once it lapsed; the old id itself, taken over,
        # is swept here (its requests closed as their clients were told)
        self._unswept = {taking_over} if took_over and taking_over is not None else set()
        self.store.writer.bind_instance(instance_id)
        self._lease_until(sent_at + self.ttl_s)
        if self._keeper is not None:
            self._keeper.bind(instance_id)
        self.ctx.refusal = None
        log.info("gateway instance %s (%s) registered", instance_id, info.name)

    def _lease_until(self, valid_until: float) -> None:
        self.valid_until = self.ctx.lease_valid_until = valid_until
        if self._expiry is not None:
            self._expiry.cancel()
        delay = max(valid_until - self.ctx.clock(), 0.0)
        self._expiry = asyncio.get_running_loop().call_later(delay, self._lapsed)

    # --- the lease ---------------------------------------------------------------------

    def _renewed(self, renewal: Renewal) -> None:
        """An answer of the keeper's, on this loop: the lease runs from its send time."""
        if renewal.instance_id != self.instance_id or self._fencing is not None:
            return
        if renewal.live is None:
            log.error("gateway instance %s: PostgreSQL says its lease is lost", renewal.instance_id)
            self._lapsed()
            return
        self._lease_until(renewal.sent_at + self.ttl_s)
        self.ctx.budget.share_among(renewal.live)
        self.ctx.metrics.gateway_instances.set(renewal.live)

    def _lapsed(self) -> None:
        last = self._keeper.last if self._keeper is not None else None
        if (
            last is not None
            and last.live is not None
            and last.instance_id == self.instance_id
            and last.sent_at + self.ttl_s > self.ctx.clock()
        ):  # answered on the keeper's thread, not yet told here: the lease runs on
            self._lease_until(last.sent_at + self.ttl_s)
            return
        if self._fencing is None:
            if self._keeper is not None:
                self._keeper.bind(None)  # the old id is renewed no more
            self._fencing = asyncio.get_running_loop().create_task(self._fenced(), name="instance fenced")

    async def _fenced(self) -> None:
        """The lease is lost: whatever this instance still holds belongs to a sweeper."""
        old = self.instance_id
        log.error("gateway instance %s is fenced: its lease lapsed; its streams end (%s)", old, GATEWAY_LOST)
        self.ctx.refusal = GATEWAY_LOST
        # nothing more is written as the old id; what the store still holds (deliveries its
        # clients got) is written once the new id is registered, which takes the old one over
        self.store.writer.hold()
        for driver in list(self.ctx.drivers.values()):
            driver.interrupt(GATEWAY_LOST, LOST_MESSAGE, record=False)
        self.ctx.metrics.instances_fenced.inc()
        try:
            while True:
                try:
                    await self._register(taking_over=old)
                    return
                except Exception as exc:
                    log.warning("gateway instance: registering again failed: %r", exc)
                    await asyncio.sleep(1.0)
        finally:
            self._fencing = None

    # --- the sweep ---------------------------------------------------------------------

    async def _sweeps(self) -> None:
        while True:
            await asyncio.sleep(self.ctx.config.sweep_interval_s)
            if self.ctx.refusal is not None:
                continue  # a fenced or draining instance takes nothing over
            if self.ctx.clock() < self._sweeps_held_until:
                continue
            try:
                await self.sweep()
            except StoreUnavailable as exc:
                self._sweeps_held_until = self.ctx.clock() + self.ttl_s
                log.warning("gateway instance %s: sweep failed: %r; sweeps wait one lease", self.instance_id, exc)
            except Exception as exc:
                log.warning("gateway instance %s: sweep failed: %r", self.instance_id, exc)

    async def sweep(self) -> int:
        """Take over lapsed instances: close their open requests. How many were closed."""
        closed = 0
        sweeper = self.instance_id
        # What it claimed before and left with requests open is still this instance's
        # to sweep: the claim passes to another only once this one lapsed.
        self._unswept.update(await self.registry.claim_lapsed(sweeper))
        for lapsed in sorted(self._unswept):
            request_ids = await self.store.unfinished_requests(gateway=lapsed)
            results = await asyncio.gather(*(self._close(request_id) for request_id in request_ids))
            closed += sum(results)
            if sum(results) < len(request_ids):
                # Not swept yet: the claim stays this instance's, and its next sweep
                # closes what is still open.
                log.warning(
                    "gateway instance %s sweeping %s: %d of %d open request(s) closed; the rest next sweep",
                    sweeper,
                    lapsed,
                    sum(results),
                    len(request_ids),
                )
                continue
            await self.registry.swept(lapsed, sweeper, len(request_ids))
            self._unswept.discard(lapsed)
            self.ctx.metrics.instances_swept.inc()
            log.warning("gateway instance %s swept %s: %d open request(s) closed", sweeper, lapsed, sum(results))
        return closed

    async def _close(self, request_id: str) -> int:
        """Close ``request_id`` from the log: with the final error this process told its
        client, if it still holds the request (its log was lost), else ``gateway_lost``."""
        driver = self.ctx.drivers.get(request_id)
        told = driver.told if driver is not None else None
        try:
            if told is not None:
                await close_from_log(self.ctx, request_id, code=told[0], message=told[1])
            else:
                await close_from_log(self.ctx, request_id)
        except Exception:  # one broken request must not keep the others open
            log.exception("could not close request %s of a lapsed instance", request_id)
            return 0
        return 1

    # --- the log's partitions ----------------------------------------------------------

    async def _maintenance(self) -> None:
        while True:
            await asyncio.sleep(self.ctx.config.maintain_interval_s)
            await self.maintain(wait=False)

    async def maintain(self, *, wait: bool) -> None:
        """Make partitions ahead and apply retention; a failure is logged, and the
        next run tries again (partitions are made days ahead)."""
        config = self.ctx.config
        try:
            done = await self.store.maintain_partitions(
                days_ahead=config.partitions_ahead_days,
                retention_days=config.retention_days,
                archive_dir=config.archive_dir,
                wait=wait,
            )
        except Exception as exc:
            log.warning("gateway instance %s: partition maintenance failed: %r", self.instance_id, exc)
            return
        if done.created or done.dropped:
            log.info("gateway instance %s: partition maintenance: %s", self.instance_id, done)

    # --- the end -----------------------------------------------------------------------

    async def drain(self, drain_s: float) -> None:
        """Refuse new requests; let open streams run up to ``drain_s``, then end them
        with ``gateway_draining`` (recorded as ``RequestFailed`` with that code)."""
        self.ctx.refusal = GATEWAY_DRAINING
        loop = asyncio.get_running_loop()
        deadline = loop.time() + drain_s
        while self._open() and loop.time() < deadline:
            await asyncio.sleep(0.05)
        for driver in list(self.ctx.drivers.values()):
            driver.interrupt(GATEWAY_DRAINING, DRAINING_MESSAGE, record=True)
        while self._open() and loop.time() < deadline + 5.0:
            await asyncio.sleep(0.05)

    def _open(self) -> bool:
        return any(driver.state.phase is not Phase.TERMINATED for driver in self.ctx.drivers.values())

    async def stop(self) -> None:
        """Stop heartbeats and sweeps, and give the lease back."""
        await ended(*self._tasks, self._fencing)
        if self._expiry is not None:
            self._expiry.cancel()
        if self._keeper is not None:
            await self._keeper.stop()
        try:
            await self.registry.release(self.instance_id)
        except Exception as exc:
            log.warning("gateway instance %s: releasing its lease failed: %r", self.instance_id, exc)
