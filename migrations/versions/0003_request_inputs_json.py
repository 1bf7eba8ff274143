"""Recorded inputs are kept as ``json``, not ``jsonb``: every valid body fits.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30

``jsonb`` cannot hold the character U+0000 (PostgreSQL's text has no NUL), so a
request whose body had one (valid JSON, valid Unicode: ``"a\\u0000b"``) lost its
recorded input, and, the inputs being written in batches, so did every request
recorded with it. ``json`` keeps the text as it was written and still answers the
JSON operators (``body->'model'``); only ``->>`` of a string holding U+0000 fails.

Downgrade turns such characters into U+FFFD, the only way back into ``jsonb``.
"""

from __future__ import annotations

from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.execute("ALTER TABLE request_inputs ALTER COLUMN body TYPE json USING body::json")


def downgrade() -> None:
    op.execute(
        "ALTER TABLE request_inputs ALTER COLUMN body TYPE jsonb USING replace(body::text, '\\u0000', '\\ufffd')::jsonb"
    )
