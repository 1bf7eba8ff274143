"""Every error the event store raises, in one tree.

    StoreError
    ├── StreamConflict       the request's stream is not where the append expected it:
    │                        a second writer got there first, or the expected version
    │                        skips or repeats versions. Never retried by the store.
    ├── StoreUnavailable     PostgreSQL cannot be reached (down, restarting, network,
    │                        no host of a multi-host URL is the writable primary, or
    │                        the server answering refuses writes as read-only).
    │                        The store logs it once and reconnects by itself; an append
    │                        that failed so may or may not have been recorded, and
    │                        retrying the same events is safe (a no-op if it was).
    ├── StoreClosed          the store was closed; nothing more is accepted.
    ├── InstanceFenced       the gateway instance this store appends for has lost its
    │                        lease (lapsed, swept or released): PostgreSQL refused the
    │                        append, and every later one, until the store is bound to
    │                        a live instance (docs/design.md §11).
    └── InvalidAppend        the events cannot be appended as given (wrong request,
                             seq not following the expected version): a caller's bug.
                             Also a ValueError.

Anything else PostgreSQL reports is raised as a plain ``StoreError`` naming it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import asyncpg
from sqlalchemy import exc as sa_exc


class StoreError(Exception):
    """Base of every error raised by :mod:`app.store`."""


class StreamConflict(StoreError):
    """Another event already holds a version this append needs, or a version was skipped."""

    def __init__(self, request_id: str, expected_version: int, detail: str) -> None:
        self.request_id = request_id
        self.expected_version = expected_version
        self.detail = detail
        super().__init__(f"request {request_id}: append at expected version {expected_version} conflicts: {detail}")


class StoreUnavailable(StoreError):
    """PostgreSQL cannot be reached now; the store keeps trying to reconnect."""


class StoreClosed(StoreError):
    """The store was closed."""


class InstanceFenced(StoreError):
    """The store's gateway instance has lost its lease; its appends are refused."""


class InvalidAppend(StoreError, ValueError):
    """The events given to ``append`` do not fit the request and version given."""


# A gap in a stream, raised by the projection trigger (migrations/versions/0001).
STREAM_GAP_SQLSTATE = "PG409"
# An append by a gateway instance whose lease lapsed (migrations/versions/0004).
INSTANCE_FENCED_SQLSTATE = "PG410"


def rejection(request_id: str, expected_version: int, error: Exception) -> StoreError:
    """What PostgreSQL's refusal of one request's append means, as a store error."""
    sqlstate = getattr(error, "sqlstate", "") or ""
    if sqlstate == INSTANCE_FENCED_SQLSTATE:
        return InstanceFenced(str(error))
    if sqlstate == STREAM_GAP_SQLSTATE or sqlstate.startswith("23"):
        return StreamConflict(request_id, expected_version, str(error))
    return StoreError(f"PostgreSQL rejected the append of request {request_id}: {error}")


# SQLSTATE classes that mean "the server is not there for us now": connection
# exceptions (08), operator intervention such as shutdown or restart (57), and
# system errors such as an I/O error (58).
_UNAVAILABLE_CLASSES = ("08", "57", "58")
# A write refused as read-only: the server answering is not (or no longer) the primary,
# as for a connection left on a demoted primary or routed to a standby. Like a failover
# under way, the writable primary is elsewhere: the store reconnects to find it.
READ_ONLY_SQLSTATE = "25006"


def is_unavailable(error: BaseException) -> bool:
    """Whether ``error`` (from asyncpg or SQLAlchemy) means PostgreSQL is unreachable."""
    for current in _chain(error):
        if isinstance(current, sa_exc.DBAPIError) and current.connection_invalidated:
            return True
        if isinstance(current, OSError | asyncio.TimeoutError | asyncpg.PostgresConnectionError):
            return True
        if isinstance(current, asyncpg.InterfaceError) and "connection is closed" in str(current):
            return True
        if isinstance(current, asyncpg.TargetServerAttributeNotMatched):
            return True  # every host answered, none is the writable primary (a failover under way)
        sqlstate = getattr(current, "sqlstate", None)
        if isinstance(sqlstate, str) and (sqlstate[:2] in _UNAVAILABLE_CLASSES or sqlstate == READ_ONLY_SQLSTATE):
            return True
    return False


def refused_as_read_only(error: BaseException) -> bool:
    """Whether ``error`` is a write refused by a server that is not the primary: the
    connections open to it are of no use for writing and should be dropped."""
    return any(getattr(current, "sqlstate", None) == READ_ONLY_SQLSTATE for current in _chain(error))


def _chain(error: BaseException) -> Iterator[BaseException]:
    """``error``, then what it wraps (SQLAlchemy's ``orig``) or was raised from, once each."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = getattr(current, "orig", None) or current.__cause__ or current.__context__
