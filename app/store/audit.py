"""Check the read models against the fold of the log (``phasegate db check``).

The read models are kept by a SQL trigger; the request's state is defined by
``statemachine.state.fold``. Two implementations of one meaning must agree, and this
is where that is checked: every request's events are folded and compared, field by
field, with its ``requests`` row and its ``request_attempts`` rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncConnection

from app.store import schema
from app.store.codec import from_row
from statemachine.errors import StateMachineError
from statemachine.events import Event
from statemachine.request_state import RequestState
from statemachine.state import fold


@dataclass(frozen=True, slots=True)
class Disagreement:
    """One field on which the read model and the fold of the log differ."""

    request_id: str
    field: str
    folded: Any
    projected: Any

    def __str__(self) -> str:
        read_model, folded = repr(self.projected), repr(self.folded)
        return f"{self.request_id}: {self.field} is {read_model} in the read model, {folded} by fold"


async def fold_disagreements(
    connection: AsyncConnection, request_ids: Sequence[str] | None = None
) -> list[Disagreement]:
    """Every disagreement between the read models and the fold, for all or some requests.

    The events and the rows are read in one snapshot: a transaction of its own at
    REPEATABLE READ, or the caller's if one is open (then its isolation decides). Read
    by statements of their own under READ COMMITTED, an append committed between them
    would show as a disagreement on a live log."""
    if connection.in_transaction():
        return await _disagreements(connection, request_ids)
    async with connection.begin():
        await connection.exec_driver_sql("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        return await _disagreements(connection, request_ids)


async def _disagreements(connection: AsyncConnection, request_ids: Sequence[str] | None) -> list[Disagreement]:
    events = schema.request_events.c
    query = select(
        events.request_id,
        events.version,
        events.type,
        events.schema_version,
        events.attempt,
        events.lease_epoch,
        events.occurred_at,
        events.body,
    ).order_by(events.request_id, events.version)
    if request_ids is not None:
        query = query.where(events.request_id.in_(request_ids))
    streams: dict[str, list[Event]] = {}
    for row in await connection.execute(query):
        streams.setdefault(row.request_id, []).append(from_row(*row))
    requests = {row.request_id: row for row in await connection.execute(_select(schema.requests, request_ids))}
    attempts: dict[str, list[Any]] = {}
    for row in await connection.execute(_select(schema.request_attempts, request_ids)):
        attempts.setdefault(row.request_id, []).append(row)
    found: list[Disagreement] = []
    for request_id in sorted(set(streams) | set(requests)):
        found.extend(_compare(request_id, streams.get(request_id, []), requests.get(request_id), attempts))
    return found


def _select(table: Any, request_ids: Sequence[str] | None) -> Any:
    query = select(table)
    if request_ids is not None:
        query = query.where(table.c.request_id.in_(request_ids))
    return query.order_by(*table.primary_key.columns)


def _compare(request_id: str, events: list[Event], row: Any, attempts: dict[str, list[Any]]) -> list[Disagreement]:
    if not events:
        return [Disagreement(request_id, "events", "none", "a requests row")]
    if row is None:
        return [Disagreement(request_id, "requests row", f"{len(events)} events", None)]
    try:
        state = fold(events)
    except StateMachineError as exc:
        return [Disagreement(request_id, "fold", str(exc), "a projected row")]
    found = [
        Disagreement(request_id, name, folded, projected)
        for name, folded, projected in _request_fields(state, row)
        if folded != projected
    ]
    rows = attempts.get(request_id, [])
    if len(rows) != len(state.attempts):
        found.append(Disagreement(request_id, "attempt rows", len(state.attempts), len(rows)))
    for attempt, projected_attempt in zip(state.attempts, rows, strict=False):
        for name, folded, projected in (
            ("lease_epoch", attempt.lease_epoch, projected_attempt.lease_epoch),
            ("replica_id", attempt.replica_id, projected_attempt.replica_id),
            ("ended", attempt.ended, projected_attempt.ended),
            ("failure_kind", attempt.failure, projected_attempt.failure_kind),
            ("first_token", attempt.first_token_received, projected_attempt.first_token_at is not None),
            ("fenced", attempt.fenced, projected_attempt.fenced_at is not None),
            ("cancel_sent", attempt.cancel_sent, projected_attempt.cancel_sent_at is not None),
            ("cancel_acked", attempt.cancel_acked, projected_attempt.cancel_acked_at is not None),
            ("lease_expired", attempt.lease_expired, projected_attempt.lease_expired_at is not None),
            ("released_because", attempt.released, projected_attempt.released_because),
        ):
            if folded != projected:
                found.append(Disagreement(request_id, f"attempt {attempt.attempt} {name}", folded, projected))
    return found


def _request_fields(state: RequestState, row: Any) -> list[tuple[str, Any, Any]]:
    return [
        ("phase", state.phase.value, row.phase),
        ("outcome", state.outcome, row.outcome),
        ("error_code", state.error_code, row.error_code),
        ("finish_reason", state.finish_reason, row.finish_reason),
        ("attempts", len(state.attempts), row.attempts),
        ("replicas_tried", list(state.replicas_tried), list(row.replicas_tried)),
        ("first_delta_attempt", state.first_delta_attempt, row.first_delta_attempt),
        ("delivered_deltas", max(state.delivered_deltas, state.read_deltas), row.delivered_deltas),
        ("delivered_output_tokens", state.delivered_output_tokens, row.delivered_output_tokens),
        ("tool_calls", len(state.tool_calls), row.tool_calls),
        ("client_disconnected", state.disconnects > 0, row.client_disconnected_at is not None),
        ("last_seq", state.seq, row.last_seq),
        ("tenant", state.tenant, row.tenant),
        ("model", state.model, row.model),
    ]
