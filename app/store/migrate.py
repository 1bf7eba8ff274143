"""Apply the schema's migrations (``migrations/``) from Python.

``phasegate db upgrade`` and the server at start call these. The async forms run
inside an event loop; the plain ones start their own. Concurrent upgrades (two
gateways starting at once) queue on an advisory lock instead of racing. The lock is
the session's, taken by polling: a waiting upgrader holds no transaction, so a
migration that builds an index ``CONCURRENTLY`` (0007), which waits for every older
snapshot, does not wait for it. Each migration is its own transaction.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Connection, pool, text
from sqlalchemy.ext.asyncio import create_async_engine

from app.store.database import sqlalchemy_url

log = logging.getLogger("phasegate.store.migrate")
MIGRATIONS = Path(__file__).resolve().parents[2] / "migrations"
_LOCK_KEY = 0x70686173_6567  # "phaseg": the advisory lock that serialises upgrades
_LOCK_POLL_S = 0.05


def alembic_config() -> Config:
    if not (MIGRATIONS / "env.py").exists():
        raise RuntimeError(f"phasegate's migrations are not at {MIGRATIONS}; install phasegate from its checkout")
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    return config


async def upgrade_async(url: str, revision: str = "head") -> None:
    """Migrate the database at ``url`` up to ``revision``."""
    await _run(url, lambda config: command.upgrade(config, revision))


async def downgrade_async(url: str, revision: str = "base") -> None:
    """Migrate the database at ``url`` down to ``revision`` (``base`` drops everything)."""
    await _run(url, lambda config: command.downgrade(config, revision))


async def current_revision_async(url: str) -> str | None:
    """The revision the database is at, or ``None`` before the first migration."""
    engine = create_async_engine(sqlalchemy_url(url), poolclass=pool.NullPool)
    try:
        async with engine.connect() as connection:
            return await connection.run_sync(lambda sync: MigrationContext.configure(sync).get_current_revision())
    finally:
        await engine.dispose()


def upgrade(url: str, revision: str = "head") -> None:
    asyncio.run(upgrade_async(url, revision))


def downgrade(url: str, revision: str = "base") -> None:
    asyncio.run(downgrade_async(url, revision))


def current_revision(url: str) -> str | None:
    return asyncio.run(current_revision_async(url))


def _revision(sync: Connection) -> str | None:
    return MigrationContext.configure(sync).get_current_revision()


async def _run(url: str, step: Callable[[Config], None]) -> None:
    engine = create_async_engine(sqlalchemy_url(url), poolclass=pool.NullPool)
    try:
        async with engine.connect() as connection:
            lock = {"key": _LOCK_KEY}
            while not (await connection.execute(text("SELECT pg_try_advisory_lock(:key)"), lock)).scalar():
                await connection.commit()  # wait outside any transaction
                await asyncio.sleep(_LOCK_POLL_S)
            await connection.commit()

            def migrate(sync: Connection) -> None:
                config = alembic_config()
                config.attributes["connection"] = sync
                step(config)

            before = await connection.run_sync(_revision)
            await connection.commit()  # no transaction open as the migrations start
            try:
                await connection.run_sync(migrate)
                await connection.commit()
                after = await connection.run_sync(_revision)
                if after != before:
                    log.info("the log's schema migrated from revision %s to %s", before or "none", after or "none")
                else:
                    log.info("the log's schema is at revision %s", after or "none")
            finally:
                await connection.rollback()
                await connection.execute(text("SELECT pg_advisory_unlock(:key)"), lock)
                await connection.commit()
    finally:
        await engine.dispose()
