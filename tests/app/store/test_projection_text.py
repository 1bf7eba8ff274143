"""The projection trigger's function is one readable text in the migrations: the live
functions' bodies (``pg_proc.prosrc`` of the parent's and of each day's) are the latest
migration's ``PROJECTION_BODY``, word for word; no later migration edits the function
without writing it whole; and the text written whole in migration 0014 is, statement for
statement, the function the migrations before it had made by patches (no behaviour changed).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest
from alembic.script import Script, ScriptDirectory

from app.store import migrate
from app.store.database import asyncpg_dsn
from app.store.migrate import alembic_config

FUNCTION = "project_request_events"


def _script() -> ScriptDirectory:
    return ScriptDirectory.from_config(alembic_config())


def _in_order() -> list[Script]:
    """Every migration, oldest first."""
    return list(reversed(list(_script().walk_revisions("base", "heads"))))


def _latest_whole(migrations: list[Script]) -> int:
    """Where the latest migration that writes the projection whole is in ``migrations``."""
    written = [at for at, migration in enumerate(migrations) if hasattr(migration.module, "PROJECTION_BODY")]
    assert written, "no migration writes the projection whole"
    return written[-1]


def _statements(body: str) -> str:
    """The body with its SQL comments and the layout of its whitespace set aside."""
    without_comments = re.sub(r"--[^\n]*", "", body)
    return " ".join(without_comments.split())


def _day_body(body: str, suffix: str) -> str:
    """The parent's body as a day's function names its tables (phasegate_day_projection)."""
    body = re.sub(r"\brequests\b", "requests" + suffix, body)
    return re.sub(r"\brequest_attempts\b", "request_attempts" + suffix, body)


@pytest.fixture
async def connection(database_url: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        yield conn
    finally:
        await conn.close()


async def test_the_live_functions_are_the_latest_migrations_text(connection: asyncpg.Connection) -> None:
    migrations = _in_order()
    body: str = migrations[_latest_whole(migrations)].module.PROJECTION_BODY
    parent = await connection.fetchrow(
        "SELECT prosrc, proconfig FROM pg_proc WHERE oid = $1::regprocedure", f"{FUNCTION}()"
    )
    assert parent["prosrc"] == body
    assert parent["proconfig"] == ["plan_cache_mode=force_generic_plan", "enable_seqscan=off"]
    days = await connection.fetch(
        "SELECT proname, prosrc, proconfig FROM pg_proc WHERE proname ~ $1 ORDER BY proname",
        f"^{FUNCTION}_p[0-9]{{8}}$",
    )
    server = await connection.fetchval("SELECT current_setting('server_version_num')::integer")
    if server >= 170000:  # older servers get no day functions (migration 0010)
        assert days, "a migrated log has days of its own, each with its function"
    for day in days:
        suffix = day["proname"].removeprefix(FUNCTION)
        assert day["prosrc"] == _day_body(body, suffix), day["proname"]
        assert day["proconfig"] == parent["proconfig"], day["proname"]


def test_no_later_migration_edits_the_function_without_writing_it_whole() -> None:
    migrations = _in_order()
    later = migrations[_latest_whole(migrations) + 1 :]
    touching = [migration.revision for migration in later if FUNCTION + "()" in Path(migration.path).read_text()]
    assert touching == [], "a migration that changes the projection writes PROJECTION_BODY whole"


async def test_the_whole_text_is_the_function_the_migration_before_it_left(empty_database_url: str) -> None:
    """0014 changed no behaviour: on a log migrated to the revision before it, the live
    function is 0014's text statement for statement (whatever that revision is)."""
    whole = _script().get_revision("0014")
    assert whole is not None and isinstance(whole.down_revision, str)
    await migrate.upgrade_async(empty_database_url, whole.down_revision)
    conn = await asyncpg.connect(asyncpg_dsn(empty_database_url))
    try:
        before: str = await conn.fetchval("SELECT prosrc FROM pg_proc WHERE oid = $1::regprocedure", f"{FUNCTION}()")
    finally:
        await conn.close()
    assert _statements(whole.module.PROJECTION_BODY) == _statements(before)
    assert before != whole.module.PROJECTION_BODY, "0014 is laid out to be read, not copied"
