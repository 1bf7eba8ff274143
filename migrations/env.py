"""alembic's environment for phasegate's schema.

Two ways in: ``app/store/migrate.py`` hands over an open connection in
``config.attributes["connection"]`` (the server migrates at start, inside its event
loop); the ``alembic`` command line connects by itself to ``sqlalchemy.url`` or
``$DATABASE_URL``. The schema is raw PostgreSQL DDL in the versions, so there is no
metadata to autogenerate from.
"""

from __future__ import annotations

import asyncio
import os
from logging.config import fileConfig

from alembic import context
from sqlalchemy import pool
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine

config = context.config

if config.config_file_name is not None and config.attributes.get("connection") is None:
    fileConfig(config.config_file_name)


def _url() -> str:
    url = config.get_main_option("sqlalchemy.url") or os.environ.get("DATABASE_URL")
    if not url:
        raise SystemExit("set DATABASE_URL (or use `phasegate db upgrade`, which starts the embedded server)")
    return url.replace("postgresql://", "postgresql+asyncpg://", 1)


def run_migrations(connection: Connection) -> None:
    context.configure(connection=connection, target_metadata=None, transaction_per_migration=True)
    with context.begin_transaction():
        context.run_migrations()


async def run_migrations_async() -> None:
    engine = create_async_engine(_url(), poolclass=pool.NullPool)
    async with engine.connect() as connection:
        await connection.run_sync(run_migrations)
        await connection.commit()
    await engine.dispose()


if context.is_offline_mode():
    context.configure(url=_url(), target_metadata=None, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
elif config.attributes.get("connection") is not None:
    run_migrations(config.attributes["connection"])
else:
    asyncio.run(run_migrations_async())
