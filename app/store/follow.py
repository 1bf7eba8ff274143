"""Following the global log without missing what commits out of position order.

The problem: ``position`` is taken from a sequence when a row is inserted, not when
its transaction commits. Transaction A may take position 10 and commit after B took
11 and committed; a follower that reads "position > last seen" would see 11, move
its cursor past 10, and never see 10.

The approach (no NOTIFY, which inside the write transaction cut throughput 3× here):
every row records its writing transaction (``txid xid8``, defaulted by PostgreSQL).
The follower reads in ``(txid, position)`` order and only rows whose transaction is
older than the oldest transaction still running, ``pg_snapshot_xmin(pg_current_snapshot())``.
Every transaction below that horizon has finished, and transaction ids only grow,
so no row can later appear behind the cursor: nothing is missed, nothing repeats.

What that costs: a transaction that stays open holds back the followers (not the
writers) until it ends, and rows come in transaction order, which is commit order
for one writer (its transactions never overlap) and seq order within a request.
Polls are woken at once by commits of the same process and otherwise every
``poll_interval``.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from app.store.codec import from_row
from statemachine.events import Event

_BEYOND = text(
    """
    SELECT position, txid, request_id, version, type, schema_version,
           attempt, lease_epoch, occurred_at, body
      FROM request_events
     WHERE (txid, position) > (CAST(:txid AS xid8), :position)
       AND txid < pg_snapshot_xmin(pg_current_snapshot())
     ORDER BY txid, position
     LIMIT :limit
    """
)

_TXID_OF = text("SELECT txid FROM request_events WHERE position = :position")


class FollowCursor:
    """Where a follower is: the last ``(txid, position)`` it returned."""

    __slots__ = ("position", "txid")

    def __init__(self, txid: int, position: int) -> None:
        self.txid = txid
        self.position = position

    @classmethod
    async def after(cls, connection: AsyncConnection, position: int) -> FollowCursor:
        """The cursor just past ``position`` (0: the start of the log)."""
        if position == 0:
            return cls(0, 0)
        txid = (await connection.execute(_TXID_OF, {"position": position})).scalar()
        if txid is None:
            raise ValueError(f"position {position} is not in the log")
        return cls(int(txid), position)

    async def next_batch(self, connection: AsyncConnection, limit: int) -> list[tuple[int, Event]]:
        """The next finished events, at most ``limit``; advances the cursor past them."""
        rows: list[Any] = list(
            await connection.execute(_BEYOND, {"txid": self.txid, "position": self.position, "limit": limit})
        )
        if rows:
            self.txid, self.position = int(rows[-1].txid), rows[-1].position
        return [
            (
                row.position,
                from_row(
                    row.request_id,
                    row.version,
                    row.type,
                    row.schema_version,
                    row.attempt,
                    row.lease_epoch,
                    row.occurred_at,
                    row.body,
                ),
            )
            for row in rows
        ]
