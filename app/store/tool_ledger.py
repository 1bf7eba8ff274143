"""The tool ledger's statements on PostgreSQL (docs/design.md §8): a tool action claimed
once per idempotency key, its outcome recorded once, and read back. Each runs on a
connection :class:`~app.store.postgres.PostgresEventStore` gives it, in its transaction.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.dialects.postgresql import insert

from app.store import schema
from app.store.base import ToolExecution
from app.store.codec import storable
from app.store.errors import StoreError


async def claim(
    connection: Any,
    idempotency_key: str,
    request_id: str,
    attempt: int,
    tool_call_id: str,
    name: str,
    arguments: str,
) -> bool:
    """Claim the tool action; ``True`` only for the first claimer of ``idempotency_key``."""
    ledger = schema.tool_executions
    statement = (
        insert(ledger)
        .values(
            idempotency_key=idempotency_key,
            request_id=request_id,
            attempt=attempt,
            tool_call_id=tool_call_id,
            name=storable(name),  # what the model wrote: it may hold U+0000
            arguments=storable(arguments),
        )
        .on_conflict_do_nothing(index_elements=[ledger.c.idempotency_key])
        .returning(ledger.c.idempotency_key)
    )
    return (await connection.execute(statement)).first() is not None


async def finish(connection: Any, idempotency_key: str, *, result: Any, error: str | None) -> None:
    """Record a claimed action's outcome; the first recorded stands."""
    ledger = schema.tool_executions
    statement = (
        update(ledger)
        .where(ledger.c.idempotency_key == idempotency_key, ledger.c.status == "claimed")
        .values(
            status="failed" if error is not None else "succeeded",
            result=storable(result),  # the tool's answer: it may hold U+0000
            error=storable(error),
            finished_at=func.now(),
        )
    )
    finished = (await connection.execute(statement)).rowcount
    if not finished:
        claimed = select(ledger.c.idempotency_key).where(ledger.c.idempotency_key == idempotency_key)
        if (await connection.execute(claimed)).first() is None:
            raise StoreError(f"tool execution {idempotency_key} was never claimed")
        # already finished: the first recorded outcome stands


async def execution(connection: Any, idempotency_key: str) -> ToolExecution | None:
    """The action recorded under ``idempotency_key``, or ``None``."""
    ledger = schema.tool_executions
    query = select(*(ledger.c[field.name] for field in dataclasses.fields(ToolExecution))).where(
        ledger.c.idempotency_key == idempotency_key
    )
    row = (await connection.execute(query)).first()
    return None if row is None else ToolExecution(*row)
