"""The log and its read models partitioned by the day each request was accepted.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01

``request_events``, ``requests``, ``request_attempts`` and ``request_inputs`` become
range-partitioned on a new column ``accepted_on`` (the UTC day of the request's
``RequestAccepted``), so every
row of one request lives in one day's partition and a day past retention is dropped
whole (``phasegate db maintain``, app/store/partitions.py), never deleted row by row.
Unique constraints must hold the partition key: ``(request_id, version, accepted_on)``
is the stream key, ``(event_id, accepted_on)`` the retried-append key. Tables that need
global uniqueness (``tool_executions``, ``idempotency_keys``, ``gateway_instances``,
``api_keys``) stay as they are.

How the conversion stays online (docs/scaling.md has the locks, step by step), on the
conversion day C:

1. ``accepted_on`` is added with a constant default, C - 1: metadata only, no rewrite.
   Every row already there, and every row a previous release appends later (it names
   no ``accepted_on``), is on that day, whatever day its request came: the rows of a
   request stay together.
2. Outside any transaction, the unique indexes the partitioned parents need are
   built ``CONCURRENTLY`` on the old tables, and a ``CHECK (accepted_on < C)`` is
   added ``NOT VALID`` and then validated (``SHARE UPDATE EXCLUSIVE``: appends go on).
3. One short transaction takes the four tables' ``ACCESS EXCLUSIVE`` lock (appends
   wait: milliseconds, no scan), renames each to ``*_legacy``, drops 0001's keys
   (the new ones, with the day, hold them), creates the partitioned parent under the
   old name and attaches the legacy table as the partition ``FROM (MINVALUE) TO (C)``:
   the validated CHECK spares the scan and the concurrent indexes are adopted, not
   built. The projection trigger moves to the parent with the partition key in each
   of its joins; day C and the next two get partitions.

The legacy partition is one partition for everything accepted before day C; retention
drops it once day C - 1 is past. The new code appends to a request it did not accept
with the day its row holds (app/store/insert.py), so the previous release's requests
carry on in the legacy partition. ``request_attempts`` loses its foreign key on
``requests``: between partitioned tables it would make every detach of a day scan.
The previous release cannot append once the switch is done: its
``ON CONFLICT (event_id)`` needs a unique index on ``event_id`` alone, which a
partitioned table cannot have. This release appends to both schemas, so roll it out
first with ``apply_migrations = false``, then convert (docs/scaling.md, "Upgrading
to partitions, rolling").

Downgrade copies the days' partitions back into the legacy table and puts 0006's
tables back (not online: it holds the tables' lock while it copies).
"""

from __future__ import annotations

from datetime import date, timedelta

from alembic import context, op
from sqlalchemy import text

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | None = None
depends_on: str | None = None

PARTITIONED = ("request_events", "requests", "request_attempts", "request_inputs")
DAYS_AHEAD = 2  # partitions made by the migration after day C's (then `phasegate db maintain`)

# The unique keys of each parent: (name, columns). Built concurrently on the old table
# first (as "<name>_legacy") and adopted by the parent's constraint at the attach.
UNIQUE_KEYS = {
    "request_events": (
        ("request_events_position_key", "position, accepted_on"),
        ("request_events_stream_part_key", "request_id, version, accepted_on"),
        ("request_events_event_part_key", "event_id, accepted_on"),
    ),
    "requests": (("requests_part_key", "request_id, accepted_on"),),
    "request_attempts": (("request_attempts_part_key", "request_id, attempt, accepted_on"),),
    "request_inputs": (("request_inputs_part_key", "request_id, accepted_on"),),
}

# The parents' plain indexes, as 0001 made them on the tables (names are the parents',
# so that a downgrade finds the legacy table's own under their old names).
INDEXES = (
    "CREATE INDEX request_events_txid_idx ON request_events (txid, position)",
    "CREATE INDEX requests_accepted_part_idx ON requests (accepted_at)",
    "CREATE INDEX requests_model_part_idx ON requests (model, accepted_at)",
    "CREATE INDEX requests_tenant_part_idx ON requests (tenant, accepted_at)",
    "CREATE INDEX requests_error_part_idx ON requests (error_code, finished_at) WHERE error_code IS NOT NULL",
    "CREATE INDEX requests_unfinished_part_idx ON requests (gateway, accepted_at) WHERE outcome IS NULL",
    "CREATE INDEX request_attempts_replica_part_idx ON request_attempts (replica_id, started_at)",
    "CREATE INDEX request_attempts_fenced_part_idx ON request_attempts (fenced_at) WHERE fenced_at IS NOT NULL",
)

# 0001's keys: dropped from the legacy table at the switch, built again by a downgrade
OLD_KEYS = {
    "request_events": (
        ("request_events_pkey", "PRIMARY KEY (position)"),
        ("request_events_event_id_key", "UNIQUE (event_id)"),
        ("request_events_stream_key", "UNIQUE (request_id, version)"),
    ),
    "requests": (("requests_pkey", "PRIMARY KEY (request_id)"),),
    "request_attempts": (("request_attempts_pkey", "PRIMARY KEY (request_id, attempt)"),),
    "request_inputs": (("request_inputs_pkey", "PRIMARY KEY (request_id)"),),
}
FOREIGN_KEY = "request_attempts_request_id_fkey"
LOCK = "LOCK TABLE request_events, requests, request_attempts, request_inputs IN ACCESS EXCLUSIVE MODE"


def _project_events() -> str:
    """0002's projection with the partition key in each of its joins, and the batch's
    days (``first_day``, ``last_day``: plpgsql variables, so parameters of the cached
    plans) bounding each UPDATE: PostgreSQL prunes the other days' partitions when the
    statement starts instead of setting up a scan of each (figures: docs/scaling.md)."""
    previous = context.script.get_revision("0002")
    assert previous is not None and previous.module is not None
    function: str = previous.module.PROJECT_EVENTS
    edits = (
        (
            "gateway, phase, accepted_at, last_event_at, last_seq)",
            "gateway, phase, accepted_at, last_event_at, last_seq,\n                              accepted_on)",
            1,
        ),
        (
            "body->>'gateway', 'new', occurred_at, occurred_at, 0\n",
            "body->>'gateway', 'new', occurred_at, occurred_at, 0, accepted_on\n",
            1,
        ),
        ("FROM (SELECT request_id,\n", "FROM (SELECT request_id, accepted_on,\n", 1),
        ("GROUP BY request_id) c", "GROUP BY request_id, accepted_on) c", 1),
        (
            "WHERE r.request_id = c.request_id\n",
            "WHERE r.request_id = c.request_id AND r.accepted_on = c.accepted_on\n"
            "           AND r.accepted_on BETWEEN first_day AND last_day\n",
            2,
        ),
        (
            "    deliveries_only boolean;\n",
            "    deliveries_only boolean;\n    first_day date;\n    last_day date;\n",
            1,
        ),
        (
            "           count(DISTINCT request_id)\n"
            "      INTO has_accepted, has_started, has_attempt_news, has_completed, deliveries_only, streams\n",
            "           count(DISTINCT request_id), min(accepted_on), max(accepted_on)\n"
            "      INTO has_accepted, has_started, has_attempt_news, has_completed, deliveries_only, streams,"
            " first_day, last_day\n",
            1,
        ),
        (
            "WITH batch AS (\n            SELECT request_id,\n",
            "WITH batch AS (\n            SELECT request_id, accepted_on,\n",
            1,
        ),
        ("GROUP BY request_id\n        ), changes", "GROUP BY request_id, accepted_on\n        ), changes", 1),
        ("started_at, lease_expires_at)\n", "started_at, lease_expires_at, accepted_on)\n", 1),
        ("(body->>'lease_expires_at')::timestamptz\n", "(body->>'lease_expires_at')::timestamptz, accepted_on\n", 1),
        ("SELECT request_id, attempt,\n", "SELECT request_id, accepted_on, attempt,\n", 1),
        ("GROUP BY request_id, attempt\n", "GROUP BY request_id, accepted_on, attempt\n", 1),
        (
            "AND a.attempt = u.attempt;",
            "AND a.attempt = u.attempt AND a.accepted_on = u.accepted_on\n"
            "           AND a.accepted_on BETWEEN first_day AND last_day;",
            1,
        ),
        ("e JOIN requests r USING (request_id)\n", "e JOIN requests r USING (request_id, accepted_on)\n", 1),
        (
            "AND a.attempt = r.attempts;",
            "AND a.attempt = r.attempts AND a.accepted_on = e.accepted_on\n"
            "           AND a.accepted_on BETWEEN first_day AND last_day\n"
            "           AND r.accepted_on BETWEEN first_day AND last_day;",
            1,
        ),
    )
    for old, new, count in edits:
        assert function.count(old) == count, f"0002's projection changed near {old!r}"
        function = function.replace(old, new)
    return function


def partition_ddl(table: str, day: date) -> str:
    """The statement that makes ``table``'s partition of ``day`` (if missing)."""
    extra = " WITH (fillfactor = 80)" if table == "requests" else ""
    return (
        f"CREATE TABLE IF NOT EXISTS {table}_p{day:%Y%m%d} PARTITION OF {table}"
        f" FOR VALUES FROM ('{day}') TO ('{day + timedelta(days=1)}'){extra}"
    )


def _parent(table: str) -> str:
    keys = ",\n    ".join(f"CONSTRAINT {name} UNIQUE ({columns})" for name, columns in UNIQUE_KEYS[table])
    # LIKE copies the columns (in their order), their defaults, NOT NULLs and generation
    # expressions; not the legacy bound, which is the legacy partition's alone
    like = f"LIKE {table}_legacy INCLUDING DEFAULTS INCLUDING GENERATED"
    return f"CREATE TABLE {table} (\n    {like},\n    {keys}\n) PARTITION BY RANGE (accepted_on)"


def upgrade() -> None:
    bind = op.get_bind()
    day = bind.execute(text("SELECT (now() AT TIME ZONE 'UTC')::date")).scalar_one()  # C, the conversion's
    before = day - timedelta(days=1)  # the legacy rows' accept day, whatever it was
    # 1. the partition key, metadata only (a constant default rewrites nothing); the
    # tables locked in the order an append takes them (the log, then its trigger's)
    # (IF EXISTS, IF NOT EXISTS: a conversion stopped in step 2 has committed step 1)
    op.execute(LOCK)
    op.execute(f"ALTER TABLE request_attempts DROP CONSTRAINT IF EXISTS {FOREIGN_KEY}")
    for table in PARTITIONED:
        op.execute(f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS accepted_on date NOT NULL DEFAULT '{before}'")
        op.execute(
            f"ALTER TABLE {table} DROP CONSTRAINT IF EXISTS {table}_legacy_bound,"
            f" ADD CONSTRAINT {table}_legacy_bound CHECK (accepted_on < '{day}') NOT VALID"
        )
    # 2. indexes and the bound's validation, with appends going on
    with op.get_context().autocommit_block():
        for table in PARTITIONED:
            for name, columns in UNIQUE_KEYS[table]:
                op.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {name}_legacy")  # an interrupted build's
                op.execute(f"CREATE UNIQUE INDEX CONCURRENTLY {name}_legacy ON {table} ({columns})")
            op.execute(f"ALTER TABLE {table} VALIDATE CONSTRAINT {table}_legacy_bound")
    # 3. the switch: one short lock, no scan
    op.execute(LOCK)
    first_position = bind.execute(text("SELECT coalesce(max(position), 0) + 1 FROM request_events")).scalar_one()
    op.execute("DROP TRIGGER request_events_project ON request_events")
    op.execute("DROP TRIGGER request_events_instance_guard ON request_events")
    op.execute("ALTER TABLE request_events ALTER COLUMN position DROP IDENTITY")
    for table in PARTITIONED:
        op.execute(f"ALTER TABLE {table} RENAME TO {table}_legacy")
        for name, _ in UNIQUE_KEYS[table]:
            op.execute(f"ALTER TABLE {table}_legacy ADD CONSTRAINT {name}_legacy UNIQUE USING INDEX {name}_legacy")
        for name, _ in OLD_KEYS[table]:  # the new keys hold them (with the day), and cost every append
            op.execute(f"ALTER TABLE {table}_legacy DROP CONSTRAINT {name}")
        op.execute(_parent(table))
        if table == "request_events":  # the positions go on from the old table's
            op.execute(
                "ALTER TABLE request_events ALTER COLUMN position"
                f" ADD GENERATED ALWAYS AS IDENTITY (START WITH {first_position})"
            )
        op.execute(f"ALTER TABLE {table} ATTACH PARTITION {table}_legacy FOR VALUES FROM (MINVALUE) TO ('{day}')")
        for offset in range(DAYS_AHEAD + 1):
            op.execute(partition_ddl(table, day + timedelta(days=offset)))
    for statement in INDEXES:
        op.execute(statement)
    op.execute("ALTER TABLE request_events ADD CONSTRAINT request_events_version_check CHECK (version >= 1)")
    op.execute(_project_events())
    # Generic plans: their partitions pruned as each statement starts, by the batch's
    # days. Left to choose, PostgreSQL planned each statement afresh, over every
    # partition, at each append (figures: docs/scaling.md).
    op.execute("ALTER FUNCTION project_request_events() SET plan_cache_mode = force_generic_plan")
    op.execute(
        "CREATE TRIGGER request_events_project AFTER INSERT ON request_events"
        " REFERENCING NEW TABLE AS new_events FOR EACH STATEMENT EXECUTE FUNCTION project_request_events()"
    )
    op.execute(
        "CREATE TRIGGER request_events_instance_guard BEFORE INSERT ON request_events"
        " FOR EACH STATEMENT EXECUTE FUNCTION guard_instance_lease()"
    )
    for table in PARTITIONED:
        # The legacy tables' policies name requests_legacy, which would keep retention
        # from dropping it; row security stays on, so without a policy a role that is
        # not the owner sees none of a partition's rows: analysts read the parents.
        op.execute(f"DROP POLICY tenant_rows ON {table}_legacy")
    _row_security(PARTITIONED)
    _repoint_policies()


# Tables whose policy reaches the tenant through ``requests``: a policy holds the table
# it names by oid, so after the rename these would read the legacy partition alone.
THROUGH_REQUESTS = ("tool_executions",)


def _tenant_policies() -> dict[str, str]:
    tenants = context.script.get_revision("0006")
    assert tenants is not None and tenants.module is not None
    policies: dict[str, str] = tenants.module.POLICIES
    return policies


def _repoint_policies() -> None:
    for table in THROUGH_REQUESTS:
        op.execute(f"DROP POLICY tenant_rows ON {table}")
        op.execute(f"CREATE POLICY tenant_rows ON {table} FOR SELECT USING ({_tenant_policies()[table]})")


def _row_security(tables: tuple[str, ...]) -> None:
    """0006's policies and grants on the new parents (the legacy tables keep theirs)."""
    tenants = context.script.get_revision("0006")
    assert tenants is not None and tenants.module is not None
    for table in tables:
        op.execute(f"ALTER TABLE {table} ENABLE ROW LEVEL SECURITY")
        op.execute(f"CREATE POLICY tenant_rows ON {table} FOR SELECT USING ({_tenant_policies()[table]})")
    analysts = tenants.module.ANALYSTS
    op.execute(
        f"DO $$ BEGIN IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{analysts}') THEN"
        f" GRANT SELECT ON {', '.join(tables)} TO {analysts}; END IF; END $$"
    )


def _repoint_policies_back() -> None:
    for table in THROUGH_REQUESTS:
        op.execute(f"CREATE POLICY tenant_rows ON {table} FOR SELECT USING ({_tenant_policies()[table]})")


def downgrade() -> None:
    bind = op.get_bind()
    op.execute(LOCK)
    for table in (*PARTITIONED, *THROUGH_REQUESTS):  # the policies that name the parent of requests
        op.execute(f"DROP POLICY tenant_rows ON {table}")
    for table in PARTITIONED:
        op.execute(f"ALTER TABLE {table} DETACH PARTITION {table}_legacy")
        op.execute(f"ALTER TABLE {table}_legacy DROP CONSTRAINT {table}_legacy_bound")
        columns = ", ".join(
            bind.execute(
                text(
                    "SELECT attname FROM pg_attribute WHERE attrelid = CAST(:table AS regclass)"
                    " AND attnum > 0 AND NOT attisdropped AND attgenerated = '' ORDER BY attnum"
                ),
                {"table": f"{table}_legacy"},
            ).scalars()
        )
        # what was appended after the conversion, into the table it came from
        op.execute(f"INSERT INTO {table}_legacy ({columns}) SELECT {columns} FROM {table} ORDER BY 1")
        op.execute(f"DROP TABLE {table}")
        op.execute(f"ALTER TABLE {table}_legacy RENAME TO {table}")
        op.execute(f"ALTER TABLE {table} DROP COLUMN accepted_on")  # its unique keys with it
        for name, definition in OLD_KEYS[table]:
            op.execute(f"ALTER TABLE {table} ADD CONSTRAINT {name} {definition}")
    first_position = bind.execute(text("SELECT coalesce(max(position), 0) + 1 FROM request_events")).scalar_one()
    op.execute(
        "ALTER TABLE request_events ALTER COLUMN position"
        f" ADD GENERATED ALWAYS AS IDENTITY (START WITH {first_position})"
    )
    op.execute(
        f"ALTER TABLE request_attempts ADD CONSTRAINT {FOREIGN_KEY}"
        " FOREIGN KEY (request_id) REFERENCES requests ON DELETE CASCADE"
    )
    _repoint_policies_back()
    for table in PARTITIONED:
        op.execute(f"CREATE POLICY tenant_rows ON {table} FOR SELECT USING ({_tenant_policies()[table]})")
    projection = context.script.get_revision("0002")
    assert projection is not None and projection.module is not None
    op.execute(projection.module.PROJECT_EVENTS)
    op.execute("ALTER FUNCTION project_request_events() RESET plan_cache_mode")
    op.execute(
        "CREATE TRIGGER request_events_project AFTER INSERT ON request_events"
        " REFERENCING NEW TABLE AS new_events FOR EACH STATEMENT EXECUTE FUNCTION project_request_events()"
    )
    op.execute(
        "CREATE TRIGGER request_events_instance_guard BEFORE INSERT ON request_events"
        " FOR EACH STATEMENT EXECUTE FUNCTION guard_instance_lease()"
    )
