"""Which PostgreSQL to use, and its URL for SQLAlchemy and for raw asyncpg.

``DATABASE_URL`` names the database; without it phasegate starts its embedded
server (:mod:`app.store.embedded`). One URL serves both drivers: SQLAlchemy wants
``postgresql+asyncpg://``, asyncpg's own ``connect()`` wants ``postgresql://``.

Several hosts (a primary and its standbys, as Patroni or CloudNativePG publish them)
are given the libpq way, ``postgresql://user@db1:5432,db2:5432/phasegate?target_session_attrs=read-write``,
or SQLAlchemy's, ``...@/phasegate?host=db1:5432&host=db2:5432&...``. Both drivers then
try the hosts in order and keep the first that matches ``target_session_attrs``, so
after a failover a reconnect finds the promoted standby. SQLAlchemy cannot parse the
libpq form, so :func:`sqlalchemy_url` rewrites it into its own; asyncpg takes the hosts
as one comma-separated ``host`` value (it keeps only the last of repeated ones).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from urllib.parse import quote, urlsplit, urlunsplit

from sqlalchemy.engine import make_url

from app.store.embedded import EmbeddedPostgres

DEFAULT_PORT = 5432


def sqlalchemy_url(url: str) -> str:
    """``url`` for SQLAlchemy on asyncpg; a plain ``postgresql://`` URL is accepted, and
    so is a libpq multi-host one (``host1:port1,host2:port2`` before the database)."""
    parsed = make_url(_hosts_into_query(url))
    if parsed.drivername not in ("postgresql", "postgres", "postgresql+asyncpg"):
        raise ValueError(f"phasegate's log needs PostgreSQL on asyncpg, not {parsed.drivername}")
    return parsed.set(drivername="postgresql+asyncpg").render_as_string(hide_password=False)


def asyncpg_dsn(url: str) -> str:
    """``url`` as asyncpg's ``connect()`` takes it (a unix socket comes as ``?host=/dir``,
    several hosts as one ``?host=h1:p1,h2:p2``)."""
    parsed = make_url(sqlalchemy_url(url))
    hosts = parsed.query.get("host")
    if isinstance(hosts, tuple):
        parsed = parsed.update_query_dict({"host": ",".join(hosts)})
    return parsed.set(drivername="postgresql").render_as_string(hide_password=False)


def _hosts_into_query(url: str) -> str:
    """The libpq multi-host form rewritten as SQLAlchemy's: ``u@h1:p1,h2/db?q`` becomes
    ``u@/db?host=h1:p1&host=h2:5432&q`` (SQLAlchemy wants a port for every host)."""
    parts = urlsplit(url)
    userinfo, at, hostspec = parts.netloc.rpartition("@")
    if "," not in hostspec:
        return url
    hosts = []
    for host in hostspec.split(","):
        if not host:
            raise ValueError(f"an empty host in the DATABASE_URL's host list {hostspec!r}")
        hosts.append(host if ":" in host.rsplit("]", 1)[-1] else f"{host}:{DEFAULT_PORT}")
    query = "&".join(f"host={quote(host, safe=':[]')}" for host in hosts)
    if parts.query:
        query += "&" + parts.query
    return urlunsplit((parts.scheme, userinfo + at, parts.path, query, parts.fragment))


def database_from_env(environ: Mapping[str, str] = os.environ) -> tuple[str, EmbeddedPostgres | None]:
    """The URL of ``DATABASE_URL``, or of the embedded server, started (returned too)."""
    url = environ.get("DATABASE_URL")
    if url:
        return sqlalchemy_url(url), None
    server = EmbeddedPostgres(environ.get("PHASEGATE_DATA_DIR"))
    return server.start(), server
