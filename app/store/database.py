"""Which PostgreSQL to use, and its URL for SQLAlchemy and for raw asyncpg.

``DATABASE_URL`` names the database; without it phasegate starts its embedded
server (:mod:`app.store.embedded`). One URL serves both drivers: SQLAlchemy wants
``postgresql+asyncpg://``, asyncpg's own ``connect()`` wants ``postgresql://``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from sqlalchemy.engine import make_url

from app.store.embedded import EmbeddedPostgres


def sqlalchemy_url(url: str) -> str:
    """``url`` for SQLAlchemy on asyncpg; a plain ``postgresql://`` URL is accepted."""
    parsed = make_url(url)
    if parsed.drivername not in ("postgresql", "postgres", "postgresql+asyncpg"):
        raise ValueError(f"phasegate's log needs PostgreSQL on asyncpg, not {parsed.drivername}")
    return parsed.set(drivername="postgresql+asyncpg").render_as_string(hide_password=False)


def asyncpg_dsn(url: str) -> str:
    """``url`` as asyncpg's ``connect()`` takes it (a unix socket comes as ``?host=/dir``)."""
    return make_url(sqlalchemy_url(url)).set(drivername="postgresql").render_as_string(hide_password=False)


def database_from_env(environ: Mapping[str, str] = os.environ) -> tuple[str, EmbeddedPostgres | None]:
    """The URL of ``DATABASE_URL``, or of the embedded server, started (returned too)."""
    url = environ.get("DATABASE_URL")
    if url:
        return sqlalchemy_url(url), None
    server = EmbeddedPostgres(environ.get("PHASEGATE_DATA_DIR"))
    return server.start(), server
