"""The read models' generated columns computed when read, not stored (PostgreSQL 18 on).

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-05

Why: ``requests.first_delta_sent`` and ``request_attempts.ended`` were ``STORED``: every
UPDATE of a row computes them again, and the projection trigger updates a request's row
by key, one statement a row (0009), so each of those statements set up both expressions
from their catalog text before it ran. A profile of PostgreSQL at 100 streams (perf,
dwarf stacks) put 3.6 % of its CPU there. Computed when read (``VIRTUAL``, PostgreSQL
18's default for a generated column), an append's statements took 515-516 µs a request
against 540-549 (``ops/bench/studies/windowed_projection.py``'s batches, side by side). Nothing
indexes either column, so nothing else changes: a query reads the same values.

On a server before 18 (no ``VIRTUAL``) this revision does nothing.

Online: one ``ALTER TABLE`` a table drops the stored column and adds the virtual one.
Both are catalog changes (no row is read or written), under an ``ACCESS EXCLUSIVE`` lock
on the table and its partitions for a moment: appends wait milliseconds. The lock waits
for every transaction already reading the table, and appends queue behind it, so run the
upgrade when no long report runs on the read models. Each column moves
to the end of its table; every reader names its columns. The downgrade adds the stored
columns back, which rewrites the tables.
"""

from __future__ import annotations

from alembic import op
from sqlalchemy import text

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | None = None
depends_on: str | None = None

# as 0001 made them: table -> (column, type, expression)
GENERATED = {
    "requests": ("first_delta_sent", "boolean", "first_delta_attempt IS NOT NULL"),
    "request_attempts": (
        "ended",
        "text",
        """CASE
        WHEN completed_at IS NOT NULL THEN 'completed'
        WHEN released_because IS NOT NULL THEN released_because
        WHEN failure_kind IN ('replica_exited', 'rejected', 'request_refused') THEN failure_kind
    END""",
    ),
}


def _virtual_supported() -> bool:
    return int(op.get_bind().execute(text("SHOW server_version_num")).scalar_one()) >= 180000


def _kind(table: str, column: str) -> str:
    """``s`` (stored) or ``v`` (virtual): how ``table``'s ``column`` is generated now."""
    found = op.get_bind().execute(
        text("SELECT attgenerated FROM pg_attribute WHERE attrelid = to_regclass(:table) AND attname = :column"),
        {"table": table, "column": column},
    )
    return str(found.scalar_one())


def _regenerate(kind: str) -> None:
    for table, (column, type_, expression) in GENERATED.items():
        if _kind(table, column) != kind[0]:
            op.execute(
                f"ALTER TABLE {table} DROP COLUMN {column},"
                f" ADD COLUMN {column} {type_} GENERATED ALWAYS AS ({expression}) {kind.upper()}"
            )


def upgrade() -> None:
    if _virtual_supported():
        _regenerate("virtual")


def downgrade() -> None:
    if _virtual_supported():
        _regenerate("stored")
