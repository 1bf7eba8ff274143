"""Partial indexes on the log for the audit queries that look for rare events.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01

docs/audit.md ("At ten million events") says which query each serves and what it
measured with and without it. Each is partial: an append of any other kind of event
only evaluates the predicate, and adds nothing to the index. The largest holds the
policy's decisions, about one event in eight.

How it stays online: ``CREATE INDEX`` on a partitioned table builds every partition's
index while it holds a ``SHARE`` lock on each, which stops the appends for the whole
build, and ``CONCURRENTLY`` is refused on a partitioned table. So each index is made
as PostgreSQL's manual describes for partitioned tables ("Partition Maintenance"):

1. ``CREATE INDEX … ON ONLY request_events``: the parent's index alone, invalid, no
   build (a ``SHARE`` lock on the parent for a moment: appends wait milliseconds);
2. outside any transaction, each partition's index built ``CONCURRENTLY`` (``SHARE
   UPDATE EXCLUSIVE``: appends go on) and attached to the parent's (``ALTER INDEX …
   ATTACH PARTITION``, metadata only: it holds the new index ``ACCESS EXCLUSIVE``, so
   appends to that day wait for it a moment, and the tables only ``ACCESS SHARE``);
   once every partition's is attached, the parent's is valid.

A partition made later (``phasegate db maintain``, a bulk load) gets the index when it
is attached. A run stopped in step 2 is run again: a partition whose index is already
attached is skipped, and an invalid index left by an interrupted build is dropped and
built again.
"""

from __future__ import annotations

from alembic import op
from sqlalchemy import text

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | None = None
depends_on: str | None = None

# name -> (its partitions' indexes are named "<partition>_<suffix>", the definition)
INDEXES = {
    "request_events_trace_idx": (
        "trace_idx",
        "((body->>'trace_id')) WHERE type = 'RequestAccepted' AND body->>'trace_id' IS NOT NULL",
    ),
    "request_events_resumed_idx": ("resumed_idx", "(occurred_at) WHERE type = 'StreamResumed'"),
    "request_events_tool_calls_idx": ("tool_calls_idx", "(occurred_at) WHERE type = 'ToolCallEmitted'"),
    "request_events_decided_idx": ("decided_idx", "(occurred_at) WHERE type = 'Decided'"),
    "request_events_client_left_idx": (
        "client_left_idx",
        "(occurred_at) WHERE type IN ('ClientDisconnected', 'ClientResumed', 'ResumeGraceExpired', 'DeltasProduced')",
    ),
}

# The partitions of request_events without an index attached to :index
_UNINDEXED = """
SELECT c.relname
  FROM pg_inherits i
  JOIN pg_class c ON c.oid = i.inhrelid
 WHERE i.inhparent = 'request_events'::regclass
   AND NOT EXISTS (SELECT FROM pg_inherits attached
                     JOIN pg_index x ON x.indexrelid = attached.inhrelid
                    WHERE attached.inhparent = to_regclass(:index) AND x.indrelid = c.oid)
 ORDER BY 1
"""


def upgrade() -> None:
    bind = op.get_bind()
    for name, (_, definition) in INDEXES.items():
        op.execute(f"CREATE INDEX IF NOT EXISTS {name} ON ONLY request_events {definition}")
    with op.get_context().autocommit_block():
        for name, (suffix, definition) in INDEXES.items():
            for partition in bind.execute(text(_UNINDEXED), {"index": name}).scalars().all():
                child = f"{partition}_{suffix}"
                op.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {child}")  # an interrupted build's
                op.execute(f"CREATE INDEX CONCURRENTLY {child} ON {partition} {definition}")
                op.execute(f"ALTER INDEX {name} ATTACH PARTITION {child}")


def downgrade() -> None:
    for name in INDEXES:
        op.execute(f"DROP INDEX IF EXISTS {name}")  # with every partition's
