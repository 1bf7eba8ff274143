"""This gateway process's view of the fleet, kept to PostgreSQL's (docs/design.md §16).

How this works: the membership lives in ``replicas`` (app/store/fleet.py). A
:class:`FleetKeeper` per gateway process listens for changes (``NOTIFY``,
app/store/fleet_listen.py: why that, there) and applies the membership to the pool at
once: a new member (or a new incarnation) gets a client and joins the pool, probed at
once; a cordoned one gets no new attempt; one that left or lapsed is retired, its live
attempts running on to their end. It reads the whole membership again after every
(re)connection of its listener and every ``RESYNC_S`` anyway.

Each tick it also:

- takes the fleet's advisory lock if it is free: the one process holding it reconciles
  the declared sources, the configuration file's replicas (source ``file``) and each
  ``[[discover]]`` name's (source ``dns``, scoped by the name), through
  :meth:`app.store.fleet.FleetStore.reconcile_declared`. Every process reads the file
  (at start, at each reload), so the one that takes the lock over reconciles the file as
  it read it; the names are resolved by the holder alone (a process without the lock
  drops its readings of them); the others write nothing;
- marks ``lapsed``, exactly once, the joined workers whose lease lapsed (any live
  instance does; a fenced or draining one does not). A process does so at its start too,
  before it reads the membership: workers whose gateways all stopped before they could
  leave (the demo's, at a Ctrl-C) never enter its pool;
- fences this process's attempts on a cordoned replica whose drain deadline passed
  (``replica_drained``: each request then follows the rule, retried before its first
  delta, ended with the §6 error after it);
- writes ``left`` for a replica asked to leave (``DELETE /admin/replicas/{id}``) once
  the log holds no live attempt on it, or its drain deadline is past.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable

from app.config import ReplicaConfig
from app.driver.context import GatewayContext
from app.replicas.base import ProbeAnswer, ReplicaClient
from app.replicas.declared import DeclaredReplicas
from app.replicas.replica import Replica
from app.store.database import asyncpg_dsn
from app.store.fleet import FleetStore
from app.store.fleet_listen import FleetListener
from app.store.fleet_model import DeclaredReplica, Member, Written, declared_models
from app.store.postgres import PostgresEventStore
from app.tasks import ended

log = logging.getLogger("phasegate.fleet")

TICK_S = 0.25  # how often drain deadlines are looked at (and a change waits at most, once heard)
RESYNC_S = 5.0  # the whole membership read again, whatever was heard
LEAD_EVERY_S = 2.0  # a process that does not hold the fleet's lock tries again this often
LAPSE_EVERY_S = 1.0  # joined workers' leases looked at this often
LEAVE_EVERY_S = 1.0  # replicas asked to leave looked at this often
JOIN_WAIT_S = 5.0  # at start, how long a process waits for the file's replicas to be members


def declared_by_file(replicas: Iterable[ReplicaConfig]) -> list[DeclaredReplica]:
    """The configuration file's replicas (or a DNS name's), as a declared source's set."""
    return [DeclaredReplica(r.id, r.url, r.kind, declared_models(r.models, dict(r.revisions))) for r in replicas]


def replica_config(member: Member) -> ReplicaConfig:
    return ReplicaConfig(
        id=member.replica_id,
        url=member.url,
        kind=member.kind,
        models=tuple(name for name, _ in member.models),
        revisions=tuple((name, revision) for name, revision in member.models if revision is not None),
    )


class FleetKeeper:
    def __init__(
        self,
        ctx: GatewayContext,
        store: PostgresEventStore,
        make_client: Callable[[ReplicaConfig], ReplicaClient],
    ) -> None:
        self.ctx = ctx
        self.fleet = FleetStore(store)
        self.make_client = make_client
        self.listener = FleetListener(asyncpg_dsn(store.url), self._heard)
        self.members: dict[str, Member] = {}  # as last read
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._probes: set[asyncio.Task[bool]] = set()
        self._counted: int | None = None  # the last fleet event counted in the metrics
        self._reconciled = False  # the file reconciled since this process took the fleet's lock
        self._failing = False  # the last tick failed (logged once an outage)
        self.declared = DeclaredReplicas(ctx.config.replicas)  # this process's reading of each source

    @property
    def actor(self) -> str:
        return f"gateway {self.ctx.gateway_id}"

    async def start(self) -> None:
        """Listen, reconcile the file if this process leads, read the fleet; then keep it."""
        await self.listener.ensure()
        await self._lead()
        if self.ctx.refusal is None:  # leases that ran out while no gateway ran: out before the pool fills
            await self._lapse()
        await self.refresh()
        wanted = {replica.id for replica in self.ctx.config.replicas}
        deadline = asyncio.get_running_loop().time() + JOIN_WAIT_S
        while wanted - set(self.members) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)  # another process leads and reconciles the same file
            await self.refresh()
        self._task = asyncio.get_running_loop().create_task(self._keep(), name="fleet keeper")

    async def stop(self) -> None:
        await ended(self._task, *self._probes)
        await self.listener.close()

    def _heard(self) -> None:
        self._wake.set()

    async def _keep(self) -> None:
        loop = asyncio.get_running_loop()
        due = dict.fromkeys(("lead", "resync", "lapse", "leave"), loop.time())
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), TICK_S)
            try:
                await self._tick(loop.time(), due)
            except Exception as exc:  # PostgreSQL away, a fenced instance: the next tick tries again
                if not self._failing:  # once an outage: the pool stays as it was meanwhile
                    log.warning("fleet: the membership cannot be kept for now (%r); the pool stays as it is", exc)
                self._failing = True
            else:
                if self._failing:
                    log.warning("fleet: the membership is kept again")
                self._failing = False

    async def _tick(self, now: float, due: dict[str, float]) -> None:
        heard = self._wake.is_set()
        self._wake.clear()
        await self.listener.ensure()
        if now >= due["lead"]:
            due["lead"] = now + LEAD_EVERY_S
            await self._lead()
        if self.listener.leading and self.declared.changed():  # others keep their reading, unwritten
            await self._reconcile_changed()
        if heard or now >= due["resync"]:
            due["resync"] = now + RESYNC_S
            await self.refresh()
        writing = self.ctx.refusal is None  # a fenced or draining instance takes nothing over
        if writing and now >= due["lapse"]:
            due["lapse"] = now + LAPSE_EVERY_S
            await self._lapse()
        if writing and now >= due["leave"]:
            due["leave"] = now + LEAVE_EVERY_S
            await self._leave_drained()
        self._fence_drained()
        await self.ctx.pool.reap()

    async def _lapse(self) -> None:
        for replica_id in await self.fleet.lapse_expired(actor=self.actor, instance_id=self.ctx.gateway_id):
            log.warning("fleet: replica %s lapsed: its lease was not renewed", replica_id)

    async def _lead(self) -> None:
        """Take the fleet's lock if it is free; holding it, reconcile every declared source as
        this process read it (again, after a reconciliation that failed: PostgreSQL away,
        this instance fenced)."""
        if not await self.listener.try_lead():
            self._reconciled = False  # whoever takes the lock next reconciles
            self.declared.drop("dns")  # resolved by the holder: a reading here would be stale
            return
        if not self._reconciled:
            log.info("fleet: this process reconciles the declared sources")
            self.declared.all_changed()
            await self._reconcile_changed()
            self._reconciled = True

    def declare(
        self, source: str, replicas: Iterable[ReplicaConfig], *, scope: str = "", drain_s: float | None = None
    ) -> None:
        """A declared source's set now (the file at a reload, a DNS name at a resolution):
        reconciled at the next tick by this process if it holds the fleet's lock."""
        self.declared.on_declared_replicas(source, replicas, scope=scope, drain_s=drain_s)
        self._wake.set()

    def forget(self, source: str, scope: str) -> None:
        """A source that declares nothing any more (a ``[[discover]]`` name a reload removed)."""
        self.declared.forget(source, scope)
        self._wake.set()

    async def _reconcile_changed(self) -> None:
        """Each declared set changed since its last reconciliation, into the fleet, if this
        process holds the fleet's lock (the holder reconciles its own reading; this process
        reconciles all of its own when it takes the lock)."""
        for key in self.declared.changed():
            source, scope = key
            if source == "file":  # the configuration this process serves now
                self.declared.declared[key] = tuple(self.ctx.config.replicas)
            replicas = self.declared.declared.get(key, ())
            drain_s = self.declared.drain_s.get(key)
            if await self.reconcile(source, declared_by_file(replicas), scope=scope, drain_s=drain_s) is None:
                self._reconciled = False  # the lock was lost: whoever holds it reconciles
                return
            self.declared.reconciled(key, tuple(replicas))

    async def probe_new(self, replica: ReplicaConfig, timeout_s: float) -> tuple[str, str | None]:
        """One health probe of a replica not in the pool yet: its answer (``healthy``,
        ``unhealthy``, ``silent``, ``incompatible``) and why it is incompatible, if it is."""
        try:
            client = self.make_client(replica)
        except Exception as exc:  # a URL its client cannot use
            log.info("fleet: no client for %s: %r", replica.url, exc)
            return ProbeAnswer.UNHEALTHY.value, None
        try:
            async with asyncio.timeout(timeout_s):
                answer = await client.health()
        except TimeoutError:
            answer = ProbeAnswer.SILENT
        except Exception as exc:  # whatever the URL does, the answer is a refusal
            log.info("fleet: probe of %s raised %r", replica.url, exc)
            answer = ProbeAnswer.UNHEALTHY
        finally:
            with contextlib.suppress(Exception):
                await client.close()
        return answer.value, client.incompatible

    async def reconcile_file(self) -> None:
        """The configuration file's replicas, brought into the fleet (source ``file``)."""
        await self.reconcile("file", declared_by_file(self.ctx.config.replicas))

    async def reconcile(
        self, source: str, declared: Iterable[DeclaredReplica], *, scope: str = "", drain_s: float | None = None
    ) -> list[Written] | None:
        """Bring a declared source (``file``, ``dns``) to ``declared``, if this process holds
        the fleet's lock: the events written; ``None`` when another process holds it (it
        reconciles its own reading of the source). The entry point for a reload or a
        resolution (:meth:`app.store.fleet.FleetStore.reconcile_declared` writes)."""
        if not await self.listener.try_lead():
            return None
        written = await self.fleet.reconcile_declared(
            source, declared, actor=self.actor, instance_id=self.ctx.gateway_id, scope=scope, drain_s=drain_s
        )
        for event in written:
            log.info("fleet: replica %s %s (%s)", event.replica_id, event.event, event.reason)
        if written:
            self._wake.set()  # applied here at once, as every other process does on the notification
        return written

    async def refresh(self) -> None:
        """Read the membership and apply it to the pool; count the changes since the last read."""
        self.apply(await self.fleet.members(current_only=True))
        last, counts = await self.fleet.counts_after(self._counted or 0)
        if self._counted is not None:  # from this process's start on: history is in fleet_events
            for (source, event), n in counts.items():
                self.ctx.metrics.fleet_changes.labels(source=source, event=event).inc(n)
        self._counted = last

    def apply(self, members: Iterable[Member]) -> None:
        pool, clock = self.ctx.pool, self.ctx.clock
        current = {member.replica_id: member for member in members}
        for replica_id in [replica_id for replica_id in pool.replicas if replica_id not in current]:
            pool.retire(replica_id)
            self.ctx.metrics.forget_replica(replica_id)
            log.info("fleet: replica %s is out of the pool", replica_id)
        for member in current.values():
            config = replica_config(member)
            replica = pool.replicas.get(member.replica_id)
            if replica is None or replica.config != config or replica.incarnation != member.incarnation:
                replica = Replica(config, self.make_client(config), incarnation=member.incarnation)
                pool.admit(replica)
                log.info("fleet: replica %s (%s) joined the pool", member.replica_id, member.url)
                probe = asyncio.get_running_loop().create_task(pool.probe(replica), name=f"probe {replica.id}")
                self._probes.add(probe)
                probe.add_done_callback(self._probes.discard)
            replica.cordoned = member.state == "cordoned"
            drain = member.drain_left_s if replica.cordoned else None
            replica.drain_deadline = None if drain is None else clock() + drain
        self.members = current

    def _fence_drained(self) -> None:
        """This process's attempts on a cordoned replica past its drain deadline: fenced."""
        now = self.ctx.clock()
        pool = self.ctx.pool
        past = [
            replica
            for replica in (*pool.replicas.values(), *pool.retired)
            if replica.cordoned and replica.drain_deadline is not None and replica.drain_deadline <= now
        ]
        if not past:
            return
        for driver in list(self.ctx.drivers.values()):
            for replica in past:
                if driver.fence_drained(replica):
                    log.warning(
                        "request %s: its attempt on %s fenced: the drain deadline passed",
                        driver.request_id,
                        replica.id,
                    )

    async def _leave_drained(self) -> None:
        """Replicas asked to leave: gone once no attempt is live on them, or past their deadline."""
        leaving = [m for m in self.members.values() if m.leaving and m.state == "cordoned"]
        if not leaving:
            return
        live = await self.fleet.live_attempts()
        for member in leaving:
            replica = self.ctx.pool.replicas.get(member.replica_id)
            deadline = None if replica is None else replica.drain_deadline
            past = deadline is not None and deadline <= self.ctx.clock()
            if live.get(member.replica_id, 0) and not past:
                continue
            written = await self.fleet.change(
                member.replica_id,
                "left",
                source=member.source,
                actor=self.actor,
                instance_id=self.ctx.gateway_id,
                reason="removed: its attempts ended" if not past else "removed: its drain deadline passed",
                incarnation=member.incarnation,
            )
            if written is not None:
                log.info("fleet: replica %s left (%s)", member.replica_id, written.reason)
