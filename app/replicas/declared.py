"""The declared sources of replicas, the configuration file and DNS discovery: the sets
each source declares now (docs/design.md §16).

Each source hands its whole set to :meth:`DeclaredReplicas.on_declared_replicas`: the
file's ``[[replicas]]`` at start and at each reload (source ``file``), and each
``[[discover]]`` name's addresses whenever they change (source ``dns``, one set per name,
the name as its ``scope``). Nothing here touches the pool: the process that holds the
fleet's advisory lock turns the sets marked changed (:meth:`DeclaredReplicas.changed`)
into fleet events (app/driver/fleet.py, ``FleetKeeper``), and every process's pool
follows the membership in PostgreSQL. Every process reads the file, so the one that takes
the lock over reconciles the file as it read it; DNS names are resolved by the lock
holder alone, and a process that does not hold it keeps no reading of them.
"""

from __future__ import annotations

from collections.abc import Iterable

from app.config import ReplicaConfig
from app.discover_config import DiscoverConfig

SOURCES = ("file", "dns")
Key = tuple[str, str]  # (source, scope)


def dns_replica_id(name: str, host: str, port: int) -> str:
    """A DNS replica's id: its address and port, then ``@`` and the name that declared it
    (the scope app/store/fleet_model.py's ``in_scope`` reads), so one name's set never
    removes another's replicas, and the same pod is the same replica whichever instance
    resolved it."""
    return f"{host}:{port}@{name}"


def dns_replicas(entry: DiscoverConfig, addresses: Iterable[tuple[str, int]]) -> tuple[ReplicaConfig, ...]:
    """The replicas a ``[[discover]]`` name's addresses declare: one per address and port
    (``[address]`` for IPv6), each model at the revision the entry names for it, if any."""
    revisions = tuple((name, revision) for name, revision in entry.models if revision is not None)
    found = []
    for address, port in sorted(addresses):
        host = f"[{address}]" if ":" in address else address
        replica_id = dns_replica_id(entry.name, host, port)
        url = f"http://{host}:{port}"
        found.append(ReplicaConfig(replica_id, url, entry.kind, entry.model_names, revisions=revisions))
    return tuple(found)


class DeclaredReplicas:
    """The set each declared source (and scope) gave last, and which ones changed since
    they were last reconciled. ``started_with``: the file's replicas at start."""

    def __init__(self, started_with: Iterable[ReplicaConfig] = ()) -> None:
        self.declared: dict[Key, tuple[ReplicaConfig, ...]] = {("file", ""): tuple(started_with)}
        self.drain_s: dict[Key, float] = {}  # how long a replica the source dropped may finish
        self._changed: set[Key] = {("file", "")}

    def on_declared_replicas(
        self, source: str, replicas: Iterable[ReplicaConfig], *, scope: str = "", drain_s: float | None = None
    ) -> None:
        """``source`` (``file``, or ``dns`` with the name as ``scope``) declares ``replicas`` now,
        in place of what it declared before. ``drain_s``: a replica it no longer declares is
        cordoned with that drain deadline, then leaves (``None``: it leaves at once)."""
        if source not in SOURCES:
            raise ValueError(f"{source!r} is not a declared source")
        key = (source, scope)
        self.declared[key] = tuple(replicas)
        if drain_s is not None:
            self.drain_s[key] = drain_s
        self._changed.add(key)

    def forget(self, source: str, scope: str = "") -> None:
        """``source`` declares nothing any more (a ``[[discover]]`` name removed by a reload):
        its replicas leave at the next reconciliation, after which it is gone."""
        if (source, scope) in self.declared:
            self.on_declared_replicas(source, (), scope=scope)

    def changed(self) -> list[Key]:
        """The sets changed since they were last reconciled, the file first."""
        return sorted(self._changed, key=lambda key: (key[0] != "file", key))

    def reconciled(self, key: Key, replicas: tuple[ReplicaConfig, ...]) -> None:
        """``key``'s set ``replicas`` is in the fleet now (unless it changed meanwhile)."""
        if self.declared.get(key) == replicas:
            self._changed.discard(key)
            if not replicas and key[0] != "file":
                del self.declared[key]
                self.drain_s.pop(key, None)

    def drop(self, source: str) -> None:
        """Forget every reading of ``source`` without declaring anything (this process does
        not hold the fleet's lock, so it neither resolves nor writes: a reading kept from
        when it did would be stale by the time it takes the lock again)."""
        for key in [key for key in self.declared if key[0] == source]:
            del self.declared[key]
            self.drain_s.pop(key, None)
            self._changed.discard(key)

    def all_changed(self) -> None:
        """Every set to be reconciled again (this process just took the fleet's lock)."""
        self._changed = set(self.declared)
