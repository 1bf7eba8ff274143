"""Gateway instances: identity, a lease renewed by heartbeat, and a guard on appends.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01

Every ``phasegate serve`` process registers one row of ``gateway_instances`` under a
generated id (docs/design.md §11) and renews its lease. An instance whose lease lapsed is
swept by a live one: ``swept_by`` claims it, ``swept_at`` says its open requests were
closed. The store's writer connection names its instance in the session setting
``phasegate.instance``; a statement-level trigger refuses any insert into
``request_events`` while that instance's lease is lapsed, swept or released, inside
the insert's own statement (no extra round trip). ``FOR KEY SHARE`` keeps a sweep
(``FOR UPDATE``) from passing an append in flight, and lets heartbeats through.
Connections that name no instance (the CLI, trace import) are not guarded.
"""

from __future__ import annotations

from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | None = None
depends_on: str | None = None

# The SQLSTATE of an append by a fenced instance (app/store/errors.py: InstanceFenced).
FENCED_SQLSTATE = "PG410"

TABLE = """
CREATE TABLE gateway_instances (
    instance_id       text PRIMARY KEY,
    name              text NOT NULL,            -- configurable; default host:port
    host              text NOT NULL,
    pid               integer NOT NULL,
    version           text NOT NULL,
    address           text,                     -- where other instances reach it
    started_at        timestamptz NOT NULL DEFAULT now(),
    lease_ttl_ms      integer NOT NULL,
    lease_expires_at  timestamptz NOT NULL,
    released_at       timestamptz,              -- a clean exit gave the lease back
    swept_by          text,                     -- the live instance that took it over
    sweep_started_at  timestamptz,
    swept_at          timestamptz,              -- its open requests were closed
    requests_swept    integer
)
"""
INDEX = """
CREATE INDEX gateway_instances_unswept_idx ON gateway_instances (lease_expires_at)
    WHERE swept_at IS NULL AND released_at IS NULL
"""
GUARD = f"""
CREATE FUNCTION guard_instance_lease() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    instance text := current_setting('phasegate.instance', true);
BEGIN
    IF instance IS NULL OR instance = '' THEN
        RETURN NULL;
    END IF;
    PERFORM 1 FROM gateway_instances
     WHERE instance_id = instance AND lease_expires_at > now()
       AND swept_by IS NULL AND released_at IS NULL
       FOR KEY SHARE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'gateway instance % is fenced: its lease lapsed', instance
              USING ERRCODE = '{FENCED_SQLSTATE}';
    END IF;
    RETURN NULL;
END
$$
"""
TRIGGER = """
CREATE TRIGGER request_events_instance_guard BEFORE INSERT ON request_events
FOR EACH STATEMENT EXECUTE FUNCTION guard_instance_lease()
"""


def upgrade() -> None:
    for statement in (TABLE, INDEX, GUARD, TRIGGER):
        op.execute(statement)


def downgrade() -> None:
    op.execute("DROP TRIGGER request_events_instance_guard ON request_events")
    op.execute("DROP FUNCTION guard_instance_lease()")
    op.execute("DROP TABLE gateway_instances")
