"""Idempotency keys: one logical request per tenant and key (docs/design.md §12).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01

A POST with ``Idempotency-Key`` claims ``(tenant, key)`` with an INSERT; the primary key
decides a race between two POSTs, never a read-then-write. The row binds the key to
the request it started and to the digest of its body: the same body attaches to that
request, another body is refused (422 ``idempotency_key_reused``). A key is kept for
``idempotency_ttl_s`` (24 h by default); an expired one may be claimed again. Its own
unpartitioned table, so the log may be partitioned later.
"""

from __future__ import annotations

from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | None = None
depends_on: str | None = None

TABLE = """
CREATE TABLE idempotency_keys (
    tenant       text NOT NULL,
    key          text NOT NULL,
    request_id   text NOT NULL,
    body_digest  text NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    expires_at   timestamptz NOT NULL,
    PRIMARY KEY (tenant, key)
)
"""


def upgrade() -> None:
    op.execute(TABLE)


def downgrade() -> None:
    op.execute("DROP TABLE idempotency_keys")
