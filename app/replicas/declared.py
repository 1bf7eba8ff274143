"""The declared sources of replicas, the configuration file and DNS discovery, and (for
now) the pool they make (docs/design.md §16).

Each source hands its whole set to :meth:`DeclaredReplicas.on_declared_replicas`: the
file's ``[[replicas]]`` at start and at each reload (source ``file``), and each
``[[discover]]`` name's addresses whenever they change (source ``dns``, one set per name,
the name as its ``scope``). This is the seam where, per docs/design.md §16, the instance
that holds the fleet's lock turns declared sets into fleet events. Until that exists, each
gateway process applies the union of the sets to its own pool, as its start does: a
replica declared anew joins the pool (and is probed at once), one that no source declares
any more leaves it, and one whose URL, kind or models changed is replaced. A replica
that leaves gets no new attempt; its live attempts run on (they hold it), and its client
is closed once the last of them ended.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from app.config import ReplicaConfig
from app.discover_config import DiscoverConfig
from app.replicas.base import ReplicaClient
from app.replicas.pool import Replica, ReplicaPool

log = logging.getLogger("phasegate.fleet")

SOURCES = ("file", "dns")
CLOSE_POLL_S = 1.0  # how often a replica that left is checked for live attempts before its client closes


def dns_replicas(entry: DiscoverConfig, addresses: Iterable[tuple[str, int]]) -> tuple[ReplicaConfig, ...]:
    """The replicas a ``[[discover]]`` name's addresses declare: one per address and port,
    its id ``address:port`` (``[address]:port`` for IPv6), so the same pod is the same
    replica whichever instance resolved it."""
    found = []
    for address, port in sorted(addresses):
        host = f"[{address}]" if ":" in address else address
        found.append(ReplicaConfig(f"{host}:{port}", f"http://{host}:{port}", entry.kind, entry.model_names))
    return tuple(found)


class DeclaredReplicas:
    """The sets each declared source gave last, and the pool made of their union.

    ``client_for`` builds a replica's client (app/gateway.py's ``replica_client``);
    ``spawn`` runs the bookkeeping a change starts (a first probe, a client closed later);
    ``started_with``: the file's replicas, the pool's at start."""

    def __init__(
        self,
        pool: ReplicaPool,
        client_for: Callable[[ReplicaConfig], ReplicaClient],
        spawn: Callable[[Coroutine[Any, Any, Any], str], Any],
        started_with: Iterable[ReplicaConfig] = (),
    ) -> None:
        self.pool = pool
        self.client_for = client_for
        self.spawn = spawn
        # (source, scope) -> its set; the file's at start, which the pool was made of
        self.declared: dict[tuple[str, str], tuple[ReplicaConfig, ...]] = {("file", ""): tuple(started_with)}

    def on_declared_replicas(self, source: str, replicas: Iterable[ReplicaConfig], *, scope: str = "") -> None:
        """``source`` (``file``, or ``dns`` with the name as ``scope``) declares ``replicas`` now,
        in place of what it declared before."""
        assert source in SOURCES, source
        self.declared[(source, scope)] = tuple(replicas)
        self._apply()

    def forget(self, source: str, scope: str = "") -> None:
        """``source`` declares nothing any more (a ``[[discover]]`` name removed by a reload)."""
        if self.declared.pop((source, scope), None) is not None:
            self._apply()

    def wanted(self) -> dict[str, ReplicaConfig]:
        """The union of every source's set, by id; the first source to name an id wins."""
        union: dict[str, ReplicaConfig] = {}
        for (source, scope), replicas in self.declared.items():
            for replica in replicas:
                if union.setdefault(replica.id, replica) != replica:
                    log.warning(
                        "replica %s is declared twice, differently; %s %s is ignored", replica.id, source, scope
                    )
        return union

    def _apply(self) -> None:
        wanted = self.wanted()
        current = self.pool.replicas
        kept = {rid: replica for rid, replica in current.items() if wanted.get(rid) == replica.config}
        added = [Replica(config, self.client_for(config)) for rid, config in wanted.items() if rid not in kept]
        left = [replica for rid, replica in current.items() if rid not in kept]
        if not added and not left:
            return
        members = {**kept, **{replica.id: replica for replica in added}}
        self.pool.set_members([members[rid] for rid in wanted])
        for replica in left:
            log.info("replica %s (%s) leaves the pool", replica.id, replica.config.url)
            self.spawn(self._close_when_idle(replica), f"close {replica.id}")
        for replica in added:
            log.info("replica %s (%s, %s) joins the pool", replica.id, replica.config.url, replica.config.kind)
            self.spawn(self.pool.probe(replica), f"probe {replica.id}")

    @staticmethod
    async def _close_when_idle(replica: Replica) -> None:
        while replica.outstanding > 0:
            await asyncio.sleep(CLOSE_POLL_S)
        await replica.client.close()
