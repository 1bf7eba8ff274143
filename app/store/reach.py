"""A gateway's start waits for the log's PostgreSQL (``DATABASE_URL``) to answer.

A gateway and its database often start together (a Compose file, a Kubernetes rollout),
or the database restarts while a gateway starts: a server not listening yet, or one that
says it is starting up or shutting down (SQLSTATE 57P03), is waited for, up to
``database_wait_s`` (:data:`START_WAIT_S` by default), with a line in the log. What
waiting cannot mend (a wrong password, a database that does not exist) and a server still
unreachable at the deadline end the start with :class:`DatabaseUnreachable`, whose
message ``phasegate serve`` prints as its one line of error (docs/configuration.md).
"""

from __future__ import annotations

import asyncio
import logging
import time

import asyncpg
from sqlalchemy.engine import make_url

from app.store.database import asyncpg_dsn

log = logging.getLogger("phasegate.store")

START_WAIT_S = 60.0  # how long a start waits for the database to answer
RETRY_S = 0.5
CONNECT_S = 5.0  # one try's deadline
SAY_EVERY_S = 10.0  # a line in the log this often while it waits
# what a server that is not up yet does: no listener, a refused or cut handshake, no
# answer in time, "the database system is starting up" (or shutting down)
NOT_UP_YET = (OSError, TimeoutError, asyncpg.CannotConnectNowError, asyncpg.ConnectionDoesNotExistError)


class DatabaseUnreachable(Exception):
    """The start cannot go on: the message says which database and why."""


async def wait_for_database(url: str, wait_s: float = START_WAIT_S) -> None:
    """Return once the database at ``url`` takes a connection; raise
    :class:`DatabaseUnreachable` for a refusal that waiting cannot mend, or at the deadline."""
    dsn = asyncpg_dsn(url)
    where = _where(dsn)
    started = time.monotonic()
    said_at: float | None = None
    while True:
        try:
            connection = await asyncpg.connect(dsn, timeout=CONNECT_S)
        except NOT_UP_YET as exc:
            waited = time.monotonic() - started
            if waited >= wait_s:
                raise DatabaseUnreachable(
                    f"the log's PostgreSQL at {where} did not answer within {wait_s:g} s: {_said(exc)}"
                ) from None
            if said_at is None or time.monotonic() - said_at >= SAY_EVERY_S:
                said_at = time.monotonic()
                log.warning(
                    "the log's PostgreSQL at %s does not answer yet (%s); waiting up to %.0f s more",
                    where,
                    _said(exc),
                    wait_s - waited,
                )
            await asyncio.sleep(RETRY_S)
        except (asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
            raise DatabaseUnreachable(f"the log's PostgreSQL at {where} refused the connection: {_said(exc)}") from None
        else:
            await connection.close()
            if said_at is not None:
                log.warning("the log's PostgreSQL at %s answers after %.1f s", where, time.monotonic() - started)
            return


def _where(dsn: str) -> str:
    """The database's hosts, port and name, without its user or password."""
    parsed = make_url(dsn)
    hosts = parsed.query.get("host") or parsed.host or "localhost"  # several: one comma-separated value
    port = f":{parsed.port}" if parsed.port else ""
    return f"{hosts if isinstance(hosts, str) else ','.join(hosts)}{port}/{parsed.database or ''}"


def _said(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__
