"""Tenants: API keys stored hashed, analysts bound to tenants, row-level security.

Revision ID: 0006
Revises: 0004
Create Date: 2026-12-01

``api_keys`` holds the SHA-256 of each key created by ``phasegate keys create``,
never the key. ``analyst_tenants`` binds PostgreSQL roles to the tenants whose rows
they may read. Every table of the log gets row-level security with one SELECT
policy: a row is visible when its request's tenant is bound to the current role
(directly or through a role it is a member of); ``analyst_tenants`` itself shows a
role its own bindings, which is what the other policies read. Tables without a
tenant column (``request_events``, ``tool_executions``, ``request_inputs``) reach it through
``requests`` (an ``EXISTS`` on the request id, by primary key), so the hot path
appends nothing more. The gateway is unaffected: it connects as the tables' owner,
which row-level security does not restrict. ``phasegate_analysts`` is the read-only
group role (SELECT on the log's tables), created when the migrating role may create
roles; roles are cluster-wide, so the downgrade leaves it in place.
"""

from __future__ import annotations

from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | None = None
depends_on: str | None = None

ANALYSTS = "phasegate_analysts"
LOG_TABLES = (
    "requests",
    "request_attempts",
    "request_events",
    "tool_executions",
    "request_inputs",
    "idempotency_keys",
)

API_KEYS = """
CREATE TABLE api_keys (
    id          text PRIMARY KEY,            -- key_…, what `phasegate keys list|revoke` name
    tenant      text NOT NULL,
    key_sha256  text NOT NULL UNIQUE CHECK (key_sha256 ~ '^[0-9a-f]{64}$'),
    created_at  timestamptz NOT NULL DEFAULT now(),
    revoked_at  timestamptz
)
"""
ANALYST_TENANTS = """
CREATE TABLE analyst_tenants (
    role_name   text NOT NULL,               -- a PostgreSQL role (a login or a group role)
    tenant      text NOT NULL,
    PRIMARY KEY (role_name, tenant)
)
"""

# A role sees the bindings of the roles it is (or is a member of); a binding that names
# a role that no longer exists is ignored (pg_has_role on a missing name would raise).
OWN_BINDINGS = """
EXISTS (SELECT 1 FROM pg_catalog.pg_roles AS role
         WHERE role.rolname = analyst_tenants.role_name
           AND pg_catalog.pg_has_role(current_user, role.oid, 'USAGE'))
"""
_BY_TENANT = "tenant IN (SELECT tenant FROM analyst_tenants)"


def _through_requests(table: str) -> str:
    return (
        "EXISTS (SELECT 1 FROM requests AS r"
        f" WHERE r.request_id = {table}.request_id AND r.tenant IN (SELECT tenant FROM analyst_tenants))"
    )


POLICIES = {
    "analyst_tenants": OWN_BINDINGS,
    "requests": _BY_TENANT,
    "request_attempts": _through_requests("request_attempts"),
    "request_events": _through_requests("request_events"),
    "tool_executions": _through_requests("tool_executions"),
    "request_inputs": _through_requests("request_inputs"),
    "idempotency_keys": _BY_TENANT,  # (migration 0005) a tenant column of its own
}

ROLE = f"""
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{ANALYSTS}') THEN
        IF (SELECT rolsuper OR rolcreaterole FROM pg_roles WHERE rolname = current_user) THEN
            BEGIN
                CREATE ROLE {ANALYSTS} NOLOGIN;
            EXCEPTION WHEN duplicate_object OR unique_violation THEN
                NULL;  -- another database of the server made it meanwhile
            END;
        ELSE
            RAISE NOTICE 'cannot create role {ANALYSTS}: create it and grant SELECT (docs/audit.md)';
            RETURN;
        END IF;
    END IF;
    GRANT SELECT ON {", ".join(LOG_TABLES)}, analyst_tenants TO {ANALYSTS};
END
$$
"""
UNGRANT = f"""
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{ANALYSTS}') THEN
        REVOKE SELECT ON {", ".join(LOG_TABLES)}, analyst_tenants FROM {ANALYSTS};
    END IF;
END
$$
"""


def upgrade() -> None:
    op.execute(API_KEYS)
    op.execute(ANALYST_TENANTS)
    for table, visible in POLICIES.items():
        op.execute(f"ALTER TABLE {table} ENABLE ROW LEVEL SECURITY")
        op.execute(f"CREATE POLICY tenant_rows ON {table} FOR SELECT USING ({visible})")
    op.execute(ROLE)


def downgrade() -> None:
    op.execute(UNGRANT)
    for table in POLICIES:
        op.execute(f"DROP POLICY tenant_rows ON {table}")
        op.execute(f"ALTER TABLE {table} DISABLE ROW LEVEL SECURITY")
    op.execute("DROP TABLE analyst_tenants")
    op.execute("DROP TABLE api_keys")
