"""The log as an analyst reads it: SQL over the read models, and their check against the fold.

Black-box helpers for tests that ran a real gateway: they open their own connection
to the test database, as ``phasegate db check`` or a SQL console would, and read
what the gateway wrote. ``read_model_row`` gives one request's ``requests`` row;
``fold_disagreements_in`` runs :func:`app.store.audit.fold_disagreements` (the read
models against ``statemachine.state.fold`` of the same events).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from sqlalchemy import select, text
from sqlalchemy.ext.asyncio import AsyncConnection, create_async_engine

from app.store import schema
from app.store.audit import Disagreement, fold_disagreements

T = TypeVar("T")


def _run(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run ``coroutine`` on a loop of its own thread (safe from sync tests and fixtures alike)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


async def _with_connection(database_url: str, work: Any) -> Any:
    engine = create_async_engine(database_url)
    try:
        async with engine.connect() as connection:
            return await work(connection)
    finally:
        await engine.dispose()


def fold_disagreements_in(database_url: str, request_ids: Sequence[str] | None = None) -> list[Disagreement]:
    """Every disagreement between the read models and the fold of the log at ``database_url``."""

    async def check(connection: AsyncConnection) -> list[Disagreement]:
        return await fold_disagreements(connection, request_ids)

    found: list[Disagreement] = _run(_with_connection(database_url, check))
    return found


def read_model_row(database_url: str, request_id: str) -> dict[str, Any]:
    """The request's row of the ``requests`` read model, as SQL gives it."""

    async def read(connection: AsyncConnection) -> dict[str, Any]:
        table = schema.requests
        row = (await connection.execute(select(table).where(table.c.request_id == request_id))).one()
        return dict(row._mapping)

    row: dict[str, Any] = _run(_with_connection(database_url, read))
    return row


def request_ids_in(database_url: str) -> list[str]:
    """Every request id the log holds."""

    async def read(connection: AsyncConnection) -> list[str]:
        table = schema.requests
        return [r.request_id for r in await connection.execute(select(table.c.request_id))]

    ids: list[str] = _run(_with_connection(database_url, read))
    return ids


def execute_sql(database_url: str, statement: str, **params: Any) -> int:
    """Run one SQL statement in its own committed transaction; returns the rows it touched."""

    async def run(connection: AsyncConnection) -> int:
        result = await connection.execute(text(statement), params)
        await connection.commit()
        return int(result.rowcount)

    touched: int = _run(_with_connection(database_url, run))
    return touched


def fetch_sql(database_url: str, statement: str, **params: Any) -> list[dict[str, Any]]:
    """The rows of one SQL query, as an analyst's console would show them."""

    async def run(connection: AsyncConnection) -> list[dict[str, Any]]:
        return [dict(row) for row in (await connection.execute(text(statement), params)).mappings()]

    rows: list[dict[str, Any]] = _run(_with_connection(database_url, run))
    return rows
