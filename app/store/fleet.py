"""The fleet's membership in PostgreSQL (docs/design.md §16): its events and its replicas.

How this works: every change is one row appended to ``fleet_events`` (migration 0013);
a row trigger projects it into ``replicas`` (one row per replica id) and sends
``NOTIFY phasegate_fleet`` in the same transaction, so the change, its projection and
its announcement commit together. Each event names the gateway instance that wrote it,
and PostgreSQL refuses the insert while that instance is fenced (:class:`InstanceFenced`).

- :meth:`FleetStore.reconcile_declared` brings a declared source (``file``, ``dns``) to
  the set it declares: ``joined`` for a new or changed replica, ``left`` for one it no
  longer lists, nothing for one already as declared. It runs under a transaction-level
  advisory lock and diffs against the committed membership inside it, so two instances
  reconciling the same declaration never write the same change twice. A cordon
  survives it (the projection keeps a cordoned replica cordoned when it joins again).
- :meth:`FleetStore.change` cordons, uncordons, or makes leave one replica: the event
  copies what the replica declared from its row, locked, and is written only from the
  states the change applies to.
- A joined worker renews a lease on its row (:meth:`FleetStore.renew`, on PostgreSQL's
  clock); :meth:`FleetStore.lapse_expired` marks each replica whose lease lapsed
  ``lapsed`` exactly once however many instances run it: the rows are claimed with
  ``FOR UPDATE SKIP LOCKED`` and re-checked on the committed row (as the instance sweep,
  :mod:`app.store.instances`).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterable
from datetime import datetime
from typing import Any

from sqlalchemy import text

from app.store import fleet_sql
from app.store.errors import InstanceFenced
from app.store.fleet_model import (
    CORDON_KEPT,
    DECLARED_SOURCES,
    MEMBER_STATES,
    RECONCILE_LOCK,
    DeclaredReplica,
    Member,
    Written,
    in_scope,
    member_of,
    models_json,
    models_of,
    new_incarnation,
)
from app.store.postgres import PostgresEventStore

_FENCED_SQLSTATE = "PG410"


def _fenced(exc: BaseException) -> bool:
    current: BaseException | None = exc
    seen: set[int] = set()
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if getattr(current, "sqlstate", None) == _FENCED_SQLSTATE:
            return True
        current = getattr(current, "orig", None) or current.__cause__
    return False


class FleetStore:
    """``fleet_events`` and ``replicas``, over a store's connection pool. ``instance_id``
    names the gateway instance that writes (``None``: unguarded, as the CLI's tools)."""

    def __init__(self, store: PostgresEventStore) -> None:
        self._store = store

    async def members(self, *, current_only: bool = False) -> list[Member]:
        where = "WHERE state IN ('serving', 'cordoned')" if current_only else ""
        async with self._store.reading() as connection:
            return [member_of(row) for row in await connection.execute(text(fleet_sql.MEMBERS.format(where=where)))]

    async def member(self, replica_id: str) -> Member | None:
        async with self._store.reading() as connection:
            rows = await connection.execute(
                text(fleet_sql.MEMBERS.format(where="WHERE replica_id = :id")), {"id": replica_id}
            )
            row = rows.first()
        return None if row is None else member_of(row)

    async def events(self, *, limit: int = 50, replica_id: str | None = None) -> list[dict[str, Any]]:
        """The latest fleet events, newest first."""
        where = "WHERE replica_id = :replica_id" if replica_id is not None else ""
        async with self._store.reading() as connection:
            rows = await connection.execute(
                text(fleet_sql.EVENTS.format(where=where)), {"limit": limit, "replica_id": replica_id}
            )
            return [
                {
                    **{k: (v.isoformat() if isinstance(v, datetime) else v) for k, v in row._mapping.items()},
                    "models": dict(models_of(row._mapping["models"])),
                }
                for row in rows
            ]

    async def counts_after(self, seq: int) -> tuple[int, dict[tuple[str, str], int]]:
        """The last event's seq, and the events after ``seq`` by (source, event)."""
        async with self._store.reading() as connection:
            rows = list(
                await connection.execute(
                    text(
                        "SELECT source, event, count(*) AS n, max(seq) AS last FROM fleet_events"
                        " WHERE seq > :seq GROUP BY source, event"
                    ),
                    {"seq": seq},
                )
            )
        last = max([seq, *(int(row.last) for row in rows)])
        return last, {(row.source, row.event): int(row.n) for row in rows}

    async def live_attempts(self) -> dict[str, int]:
        """Live attempts by replica, across every instance, from the log's read models."""
        async with self._store.reading() as connection:
            return {row.replica_id: int(row.live) for row in await connection.execute(text(fleet_sql.LIVE_ATTEMPTS))}

    async def join(
        self, declared: DeclaredReplica, *, source: str, actor: str, instance_id: str | None, reason: str | None = None
    ) -> Written:
        """``declared`` joins (or joins again: a new incarnation replaces the old, which leaves)."""
        async with self._writing() as connection:
            await connection.execute(
                text("SELECT 1 FROM replicas WHERE replica_id = :id FOR UPDATE"), {"id": declared.replica_id}
            )
            return await self._join(connection, declared, source, actor, instance_id, reason)

    async def refuse(
        self, declared: DeclaredReplica, *, source: str, actor: str, reason: str, instance_id: str | None
    ) -> Written:
        """A replica that asked to join and was refused, recorded as such."""
        async with self._writing() as connection:
            return await self._insert(connection, "refused", declared, source, actor, reason, instance_id)

    async def change(
        self,
        replica_id: str,
        event: str,
        *,
        source: str,
        actor: str,
        instance_id: str | None,
        reason: str | None = None,
        drain_s: float | None = None,
        incarnation: str | None = None,
        leaving: bool = False,
    ) -> Written | None:
        """``cordoned``, ``uncordoned`` or ``left`` for ``replica_id``; ``None`` when it is in
        no state that the change applies to (unknown, already left or lapsed; an uncordon
        of a replica that is not cordoned). ``leaving`` with a cordon: the replica leaves
        once its attempts end or its drain deadline passed (app/driver/fleet.py)."""
        states = {"cordoned": MEMBER_STATES, "uncordoned": ("cordoned",), "left": MEMBER_STATES}[event]
        async with self._writing() as connection:
            row = (
                await connection.execute(
                    text("SELECT incarnation FROM replicas WHERE replica_id = :id FOR UPDATE"), {"id": replica_id}
                )
            ).first()
            if row is None or (incarnation is not None and row.incarnation != incarnation):
                return None
            drain_ms = None if drain_s is None else round(drain_s * 1000)
            seq = (
                await connection.execute(
                    text(fleet_sql.CHANGE),
                    {
                        "event": event,
                        "source": source,
                        "actor": actor,
                        "reason": reason,
                        "drain_ms": drain_ms,
                        "instance_id": instance_id,
                        "replica_id": replica_id,
                        "states": list(states),
                    },
                )
            ).scalar()
            if seq is not None and leaving:
                await connection.execute(
                    text("UPDATE replicas SET leaving = true WHERE replica_id = :id"), {"id": replica_id}
                )
        return None if seq is None else Written(seq, event, replica_id, source, reason)

    async def reconcile_declared(
        self,
        source: str,
        declared: Iterable[DeclaredReplica],
        *,
        actor: str,
        instance_id: str | None,
        scope: str = "",
        drain_s: float | None = None,
    ) -> list[Written]:
        """Bring ``source``'s replicas to ``declared``: the fleet events written (none when
        it already is). The one entry point for declared sources (the file, DNS).

        ``scope``: only ``source``'s replicas whose id is in it may leave (a DNS name's:
        one name's set never removes another's). ``drain_s``: a replica no longer declared
        is cordoned with that drain deadline and leaves once its attempts end or the
        deadline passed (app/driver/fleet.py writes ``left``); ``None``: it leaves at once."""
        if source not in DECLARED_SOURCES:
            raise ValueError(f"{source!r} is not a declared source ({', '.join(DECLARED_SOURCES)})")
        wanted = {d.replica_id: d for d in declared}
        written: list[Written] = []
        async with self._writing() as connection:
            await connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": RECONCILE_LOCK})
            rows = await connection.execute(text(fleet_sql.MEMBERS.format(where="") + " FOR UPDATE"))
            current = {member.replica_id: member for member in map(member_of, rows)}
            for replica_id, want in sorted(wanted.items()):
                have = current.get(replica_id)
                if have is not None and have.member and (have.source != source or want.same_as(have)):
                    continue  # as declared; or another source's, which keeps it
                written.append(await self._join(connection, want, source, actor, instance_id, f"declared by {source}"))
            for replica_id, have in sorted(current.items()):
                if have.source != source or not have.member or replica_id in wanted:
                    continue
                if not in_scope(replica_id, scope) or (drain_s is not None and have.leaving):
                    continue  # another name's; or already on its way out
                why = f"no longer in the {source}" + (f" {scope}" if scope else "")
                if drain_s is None:
                    written.append(await self._leave(connection, have, source, actor, instance_id, why))
                    continue
                cordon: dict[str, Any] = {"event": "cordoned", "source": source, "actor": actor, "reason": why}
                cordon |= {"drain_ms": round(drain_s * 1000), "instance_id": instance_id}
                cordon |= {"replica_id": replica_id, "states": list(MEMBER_STATES)}
                seq = (await connection.execute(text(fleet_sql.CHANGE), cordon)).scalar_one()
                await connection.execute(
                    text("UPDATE replicas SET leaving = true WHERE replica_id = :id"), {"id": replica_id}
                )
                written.append(Written(int(seq), "cordoned", replica_id, source, why))
        return written

    async def renew(self, replica_id: str, incarnation: str, ttl_s: float) -> str | None:
        """Extend a joined worker's lease by ``ttl_s`` from PostgreSQL's now: its state, or
        ``None`` when it is no member under that incarnation (lapsed, left, replaced)."""
        async with self._writing() as connection:
            rows = await connection.execute(
                text(fleet_sql.RENEW),
                {"replica_id": replica_id, "incarnation": incarnation, "ttl_ms": round(ttl_s * 1000)},
            )
            row = rows.first()
        return None if row is None else str(row.state)

    async def lapse_expired(self, *, actor: str, instance_id: str | None, limit: int = 64) -> list[str]:
        """Mark ``lapsed`` each member whose lease lapsed, exactly once: the ids marked."""
        async with self._writing() as connection:
            rows = await connection.execute(
                text(fleet_sql.LAPSE), {"actor": actor, "instance_id": instance_id, "limit": limit}
            )
            return [row.replica_id for row in rows]

    # --- internals -------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _writing(self) -> AsyncIterator[Any]:
        """A writing transaction whose refusal for a fenced instance is :class:`InstanceFenced`."""
        try:
            async with self._store.writing() as connection:
                yield connection
        except InstanceFenced:
            raise
        except Exception as exc:
            if _fenced(exc):
                raise InstanceFenced(str(exc).splitlines()[0]) from exc
            raise

    async def _join(
        self,
        connection: Any,
        declared: DeclaredReplica,
        source: str,
        actor: str,
        instance_id: str | None,
        reason: str | None,
    ) -> Written:
        have = (
            await connection.execute(
                text(fleet_sql.MEMBERS.format(where="WHERE replica_id = :id")), {"id": declared.replica_id}
            )
        ).first()
        incarnation = declared.incarnation or new_incarnation()
        old = None if have is None else member_of(have)
        replaced = old is not None and old.member and old.incarnation != incarnation
        if old is not None and replaced:
            await self._leave(connection, old, old.source, actor, instance_id, "replaced by a new incarnation")
        declared = DeclaredReplica(declared.replica_id, declared.url, declared.kind, declared.models, incarnation)
        written = await self._insert(connection, "joined", declared, source, actor, reason, instance_id)
        if old is not None and replaced and old.state == "cordoned":  # a cordon lasts until it is lifted
            await self._insert(connection, "cordoned", declared, source, actor, CORDON_KEPT, instance_id)
        return written

    async def _leave(
        self, connection: Any, member: Member, source: str, actor: str, instance_id: str | None, reason: str
    ) -> Written:
        declared = DeclaredReplica(member.replica_id, member.url, member.kind, member.models, member.incarnation)
        return await self._insert(connection, "left", declared, source, actor, reason, instance_id)

    @staticmethod
    async def _insert(
        connection: Any,
        event: str,
        declared: DeclaredReplica,
        source: str,
        actor: str,
        reason: str | None,
        instance_id: str | None,
    ) -> Written:
        seq = (
            await connection.execute(
                text(fleet_sql.INSERT),
                {
                    "event": event,
                    "replica_id": declared.replica_id,
                    "incarnation": declared.incarnation or new_incarnation(),
                    "kind": declared.kind,
                    "url": declared.url,
                    "models": models_json(declared.models),
                    "source": source,
                    "actor": actor,
                    "reason": reason,
                    "instance_id": instance_id,
                },
            )
        ).scalar_one()
        return Written(int(seq), event, declared.replica_id, source, reason)
