"""The fleet's vocabulary and rows (docs/design.md §16): what a source declares of a
replica (:class:`DeclaredReplica`), a row of ``replicas`` (:class:`Member`), a fleet event as
written (:class:`Written`); :mod:`app.store.fleet` reads and writes them."""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

EVENTS = ("joined", "cordoned", "uncordoned", "left", "lapsed", "refused")
STATES = ("serving", "cordoned", "left", "lapsed")
SOURCES = ("file", "dns", "admin", "join")
DECLARED_SOURCES = ("file", "dns")
MEMBER_STATES = ("serving", "cordoned")  # members: placement may see them
RECONCILE_LOCK = 0x70686173_666C  # "phasfl": serialises the reconciliations of declared sources
CORDON_KEPT = "the cordon stays on its new incarnation"

Models = tuple[tuple[str, "str | None"], ...]  # each model with its declared revision (None: undeclared)


def new_incarnation() -> str:
    return uuid.uuid4().hex[:16]


@dataclass(frozen=True, slots=True)
class DeclaredReplica:
    """One replica as a source declares it."""

    replica_id: str
    url: str
    kind: str = "worker"
    models: Models = ()  # empty: every configured model
    incarnation: str = ""  # empty: a new one is made when it joins

    def same_as(self, member: Member) -> bool:
        return (self.url, self.kind, dict(self.models)) == (member.url, member.kind, dict(member.models))


@dataclass(frozen=True, slots=True)
class Member:
    """One row of ``replicas``."""

    replica_id: str
    incarnation: str
    kind: str
    url: str
    models: Models
    state: str
    source: str
    since: datetime
    last_seq: int
    drain_until: datetime | None = None
    leaving: bool = False
    lease_expires_at: datetime | None = None
    drain_left_s: float | None = None  # to its drain deadline, on PostgreSQL's clock when read

    @property
    def member(self) -> bool:
        return self.state in MEMBER_STATES

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.replica_id,
            "incarnation": self.incarnation,
            "kind": self.kind,
            "url": self.url,
            "models": [{"name": name, "revision": revision} for name, revision in self.models],
            "state": self.state,
            "source": self.source,
            "since": self.since.isoformat(),
            "drain_until": self.drain_until.isoformat() if self.drain_until else None,
            "leaving": self.leaving,
        }


@dataclass(frozen=True, slots=True)
class Written:
    """A fleet event as written."""

    seq: int
    event: str
    replica_id: str
    source: str
    reason: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)


def models_json(models: Models) -> str:
    return json.dumps(dict(models), sort_keys=True)


def models_of(value: Any) -> Models:
    if isinstance(value, str):
        value = json.loads(value)
    return tuple(sorted((str(name), revision) for name, revision in (value or {}).items()))


def member_of(row: Any) -> Member:
    m = row._mapping
    return Member(
        replica_id=m["replica_id"],
        incarnation=m["incarnation"],
        kind=m["replica_kind"],
        url=m["url"],
        models=models_of(m["models"]),
        state=m["state"],
        source=m["source"],
        since=m["since"],
        last_seq=m["last_seq"],
        drain_until=m["drain_until"],
        leaving=m["leaving"],
        lease_expires_at=m["lease_expires_at"],
        drain_left_s=m["drain_left_s"],
    )


def declared_models(names: Sequence[str], revisions: Mapping[str, str]) -> Models:
    """``names`` (empty: every model) each with its revision in ``revisions``, if any."""
    return tuple(sorted((name, revisions.get(name)) for name in names))


def in_scope(replica_id: str, scope: str) -> bool:
    """Whether ``replica_id`` is in a declared source's ``scope`` (empty: every id). A
    scoped source (a DNS name) names its replicas ``ADDRESS:PORT@SCOPE``
    (app/replicas/declared.py), so one scope never removes another's replicas."""
    return not scope or replica_id.endswith(f"@{scope}")
