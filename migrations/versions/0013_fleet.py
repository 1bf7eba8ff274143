"""The fleet: replicas that join, are cordoned and leave, beside the log (docs/design.md §16).

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-06

``fleet_events`` is append-only (a trigger refuses UPDATE and DELETE): each change of
membership, with its source (``file``, ``dns``, ``admin``, ``join``), its actor, its
reason and PostgreSQL's ``now()``. ``replicas`` is its projection, one row per replica
id, kept by a row trigger in the insert's own transaction: the replica's state
(``serving``, ``cordoned``, ``left``, ``lapsed``), where it came from, since when, and
what it declared (kind, URL, models with their revisions), and whether it was asked to
leave (``leaving``: set with the cordon that removal writes first). A joined worker's lease
(``lease_expires_at``) lives on its row: renewals are not fleet events. The trigger
also sends ``NOTIFY phasegate_fleet`` with the event's ``seq``, delivered when the
transaction commits, which is how every gateway process learns of a change within a
second (app/store/fleet_listen.py).

A fenced instance writes no fleet event: each event names the instance that wrote it
(``instance_id``), and a row trigger refuses it, as migration 0004's guard refuses a
fenced instance's appends (SQLSTATE ``PG410``), while that instance's lease is lapsed,
swept or released. The audit role (``phasegate_analysts``, migration 0006) reads both
tables; they hold no tenant's data, so no row-level security applies.
"""

from __future__ import annotations

from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | None = None
depends_on: str | None = None

ANALYSTS = "phasegate_analysts"
CHANNEL = "phasegate_fleet"
FENCED_SQLSTATE = "PG410"

TABLES = (
    """
CREATE TABLE fleet_events (
    seq          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event        text NOT NULL CHECK (event IN ('joined', 'cordoned', 'uncordoned', 'left', 'lapsed', 'refused')),
    replica_id   text NOT NULL,
    incarnation  text NOT NULL,
    replica_kind text NOT NULL CHECK (replica_kind IN ('worker', 'openai')),
    url          text NOT NULL,
    models       jsonb NOT NULL DEFAULT '{}',   -- model -> its revision (null: undeclared); {}: every model
    source       text NOT NULL CHECK (source IN ('file', 'dns', 'admin', 'join')),
    actor        text NOT NULL,                 -- who: an instance, the admin token, a worker
    reason       text,
    drain_until  timestamptz,                   -- a cordon's drain deadline
    instance_id  text,                          -- the gateway instance that wrote it
    at           timestamptz NOT NULL DEFAULT now()
)
""",
    "CREATE INDEX fleet_events_replica_idx ON fleet_events (replica_id, seq)",
    "CREATE INDEX fleet_events_at_idx ON fleet_events (at)",
    """
CREATE TABLE replicas (
    replica_id       text PRIMARY KEY,
    incarnation      text NOT NULL,
    replica_kind     text NOT NULL,
    url              text NOT NULL,
    models           jsonb NOT NULL,
    state            text NOT NULL CHECK (state IN ('serving', 'cordoned', 'left', 'lapsed')),
    source           text NOT NULL,
    since            timestamptz NOT NULL,
    last_seq         bigint NOT NULL,
    drain_until      timestamptz,
    leaving          boolean NOT NULL DEFAULT false,  -- asked to leave once its attempts end
    lease_ttl_ms     integer,                          -- a joined worker's lease
    lease_expires_at timestamptz
)
""",
    "CREATE INDEX replicas_leases_idx ON replicas (lease_expires_at) WHERE state IN ('serving', 'cordoned')",
)

APPEND_ONLY = (
    """
CREATE FUNCTION fleet_events_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'fleet_events is append-only';
END
$$
""",
    """
CREATE TRIGGER fleet_events_append_only BEFORE UPDATE OR DELETE ON fleet_events
FOR EACH ROW EXECUTE FUNCTION fleet_events_append_only()
""",
)

GUARD = (
    f"""
CREATE FUNCTION guard_fleet_writer() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.instance_id IS NULL THEN
        RETURN NEW;
    END IF;
    PERFORM 1 FROM gateway_instances
     WHERE instance_id = NEW.instance_id AND lease_expires_at > now()
       AND swept_by IS NULL AND released_at IS NULL
       FOR KEY SHARE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'gateway instance % is fenced: it writes no fleet event', NEW.instance_id
              USING ERRCODE = '{FENCED_SQLSTATE}';
    END IF;
    RETURN NEW;
END
$$
""",
    """
CREATE TRIGGER fleet_events_writer_guard BEFORE INSERT ON fleet_events
FOR EACH ROW EXECUTE FUNCTION guard_fleet_writer()
""",
)

PROJECTION = (
    f"""
CREATE FUNCTION project_fleet_event() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.event = 'joined' THEN
        INSERT INTO replicas (replica_id, incarnation, replica_kind, url, models, state, source, since, last_seq)
        VALUES (NEW.replica_id, NEW.incarnation, NEW.replica_kind, NEW.url, NEW.models, 'serving',
                NEW.source, NEW.at, NEW.seq)
        ON CONFLICT (replica_id) DO UPDATE SET
            incarnation = EXCLUDED.incarnation, replica_kind = EXCLUDED.replica_kind, url = EXCLUDED.url,
            models = EXCLUDED.models, source = EXCLUDED.source, last_seq = EXCLUDED.last_seq,
            -- a cordon survives re-registrations until it is lifted (docs/design.md §16)
            state = CASE WHEN replicas.state = 'cordoned' THEN 'cordoned' ELSE 'serving' END,
            since = CASE WHEN replicas.state IN ('serving', 'cordoned') THEN replicas.since ELSE EXCLUDED.since END,
            leaving = false, lease_ttl_ms = NULL, lease_expires_at = NULL;
    ELSIF NEW.event = 'cordoned' THEN
        UPDATE replicas SET state = 'cordoned', drain_until = NEW.drain_until, last_seq = NEW.seq,
               since = CASE WHEN state = 'cordoned' THEN since ELSE NEW.at END
         WHERE replica_id = NEW.replica_id;
    ELSIF NEW.event = 'uncordoned' THEN
        UPDATE replicas SET state = 'serving', drain_until = NULL, leaving = false, last_seq = NEW.seq,
               since = NEW.at
         WHERE replica_id = NEW.replica_id;
    ELSIF NEW.event IN ('left', 'lapsed') THEN
        UPDATE replicas SET state = NEW.event, drain_until = NULL, leaving = false, last_seq = NEW.seq,
               since = NEW.at, lease_expires_at = NULL
         WHERE replica_id = NEW.replica_id AND incarnation = NEW.incarnation;
    END IF;  -- refused: not a member
    PERFORM pg_notify('{CHANNEL}', NEW.seq::text);
    RETURN NULL;
END
$$
""",
    """
CREATE TRIGGER fleet_events_projection AFTER INSERT ON fleet_events
FOR EACH ROW EXECUTE FUNCTION project_fleet_event()
""",
)

GRANT = f"""
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{ANALYSTS}') THEN
        GRANT SELECT ON fleet_events, replicas TO {ANALYSTS};
    END IF;
END
$$
"""


def upgrade() -> None:
    for statement in (*TABLES, *APPEND_ONLY, *GUARD, *PROJECTION, GRANT):
        op.execute(statement)


def downgrade() -> None:
    op.execute("DROP TABLE replicas")
    op.execute("DROP TABLE fleet_events")
    for function in ("project_fleet_event", "guard_fleet_writer", "fleet_events_append_only"):
        op.execute(f"DROP FUNCTION {function}()")
