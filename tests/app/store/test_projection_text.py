"""The projection trigger's function is one readable text in the migrations: the live
functions' bodies (``pg_proc.prosrc`` of the parent's and of each day's) are the latest
migration's ``PROJECTION_BODY``, word for word; no later migration edits the function
without writing it whole; and the text written whole in migration 0014 is, statement for
statement, the function the patches of 0007, 0009 and 0012 had made (no behaviour changed).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest
from alembic.runtime.environment import EnvironmentContext
from alembic.script import Script, ScriptDirectory

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


def test_the_whole_text_is_the_function_the_patches_made() -> None:
    config = alembic_config()
    script = ScriptDirectory.from_config(config)
    whole = script.get_revision("0014")
    patched = script.get_revision("0012")
    assert whole is not None and patched is not None
    with EnvironmentContext(config, script):  # 0012 reads 0009's module, which reads 0007's
        made: str = patched.module.projection()
    patched_body = made[made.index("$fn$") + len("$fn$") : made.rindex("$fn$")]
    assert _statements(whole.module.PROJECTION_BODY) == _statements(patched_body)
    assert patched_body != whole.module.PROJECTION_BODY, "0014 is laid out to be read, not copied"
