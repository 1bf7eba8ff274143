"""The schema's migrations: up and down, on empty and populated databases."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from datetime import date
from pathlib import Path

import asyncpg
import pytest
from alembic.script import ScriptDirectory

from app import cli
from app.store import PostgresEventStore, migrate
from app.store.database import asyncpg_dsn
from app.store.partitions import ensure_days, partitions
from ops import traces

ROOT = Path(__file__).resolve().parents[3]
OURS = {
    "request_events",
    "requests",
    "request_attempts",
    "tool_executions",
    "request_inputs",
    "gateway_instances",
    "idempotency_keys",
    "api_keys",
    "analyst_tenants",
    "fleet_events",
    "replicas",
}


async def tables(url: str) -> set[str]:
    """The tables of the schema, a partitioned table's partitions not counted."""
    connection = await asyncpg.connect(asyncpg_dsn(url))
    try:
        rows = await connection.fetch(
            "SELECT relname FROM pg_class WHERE relnamespace = 'public'::regnamespace"
            " AND relkind IN ('r', 'p') AND NOT relispartition"
        )
    finally:
        await connection.close()
    return {row[0] for row in rows} - {"alembic_version"}


async def populate(url: str) -> None:
    store = await PostgresEventStore.connect(url)
    try:
        for number, scenario in enumerate((traces.completed, traces.fenced_then_retried, traces.in_flight)):
            trace = scenario(f"req_{number}")
            await store.append(trace.request_id, 0, trace.events)
        await store.claim_tool_execution("req_0:call_1", "req_0", 1, "call_1", "f", "{}")
        await store.record_input("req_0", {"model": "tiny-llm"})
    finally:
        await store.close()


async def test_up_and_down_on_an_empty_database(empty_database_url: str) -> None:
    url = empty_database_url
    await migrate.upgrade_async(url)
    assert await tables(url) == OURS
    assert (
        await migrate.current_revision_async(url)
        == ScriptDirectory.from_config(migrate.alembic_config()).get_current_head()
    )
    await migrate.downgrade_async(url, "base")
    assert await tables(url) == set()
    assert await migrate.current_revision_async(url) is None
    await migrate.upgrade_async(url)
    assert await tables(url) == OURS


async def test_down_and_up_on_a_populated_database(database_url: str) -> None:
    await populate(database_url)
    await migrate.upgrade_async(database_url)  # already at head: nothing to do, nothing lost
    store = await PostgresEventStore.connect(database_url)
    assert len(await store.read("req_1")) == len(traces.fenced_then_retried("req_1").events)
    await store.close()
    await migrate.downgrade_async(database_url, "base")
    assert await tables(database_url) == set()
    await migrate.upgrade_async(database_url)
    await populate(database_url)  # usable again


async def test_every_revision_steps_up_and_back_down(empty_database_url: str) -> None:
    script = ScriptDirectory.from_config(migrate.alembic_config())
    revisions = list(reversed(list(script.walk_revisions())))
    for revision in revisions:
        await migrate.upgrade_async(empty_database_url, revision.revision)
        assert not isinstance(revision.down_revision, tuple | list), "a merge: step it by hand"
        await migrate.downgrade_async(empty_database_url, revision.down_revision or "base")
        await migrate.upgrade_async(empty_database_url, revision.revision)
    assert await migrate.current_revision_async(empty_database_url) == script.get_current_head()


async def test_concurrent_upgrades_wait_for_each_other(empty_database_url: str) -> None:
    await asyncio.gather(*(migrate.upgrade_async(empty_database_url) for _ in range(3)))
    assert await tables(empty_database_url) == OURS


async def test_other_tables_in_the_database_are_left_alone(empty_database_url: str) -> None:
    connection = await asyncpg.connect(asyncpg_dsn(empty_database_url))
    try:
        await connection.execute("CREATE TABLE someone_elses (id int); INSERT INTO someone_elses VALUES (1)")
        await migrate.upgrade_async(empty_database_url)
        await migrate.downgrade_async(empty_database_url, "base")
        assert await connection.fetchval("SELECT count(*) FROM someone_elses") == 1
    finally:
        await connection.close()


def test_phasegate_db_upgrade_and_check(
    empty_database_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DATABASE_URL", empty_database_url)
    assert cli.main(["db", "upgrade"]) == 0
    assert cli.main(["db", "current"]) == 0
    assert cli.main(["db", "check"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "schema at revision 0016",
        "0016",
        "0 disagreements between the read models and the log",
    ]
    assert cli.main(["db", "downgrade", "base"]) == 0


def test_the_alembic_command_line_uses_database_url(empty_database_url: str) -> None:
    environment = {**os.environ, "DATABASE_URL": empty_database_url}
    alembic = [sys.executable, "-m", "alembic", "-c", str(ROOT / "alembic.ini")]
    subprocess.run([*alembic, "upgrade", "head"], env=environment, check=True, capture_output=True, cwd=ROOT)
    current = subprocess.run([*alembic, "current"], env=environment, check=True, capture_output=True, cwd=ROOT)
    assert "0016 (head)" in current.stdout.decode()


async def test_inputs_holding_nul_survive_a_downgrade_as_replacement_characters(database_url: str) -> None:
    store = await PostgresEventStore.connect(database_url)
    try:
        await store.record_input("req_nul", {"messages": [{"role": "user", "content": "a\x00b"}]})
    finally:
        await store.close()
    await migrate.downgrade_async(database_url, "0002")  # request_inputs.body back to jsonb
    connection = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        content = await connection.fetchval(
            "SELECT body->'messages'->0->>'content' FROM request_inputs WHERE request_id = 'req_nul'"
        )
    finally:
        await connection.close()
    assert content == "a\N{REPLACEMENT CHARACTER}b"
    await migrate.upgrade_async(database_url)


# Each of 0008's indexes on request_events, and each partition's index attached to it
# (valid or not): (parent index, partition, its index, valid)
AUDIT_INDEXES = """
SELECT parent.indexrelid::regclass::text, child.indrelid::regclass::text, child.indexrelid::regclass::text,
       child.indisvalid AND parent.indisvalid
  FROM pg_index parent
  JOIN pg_inherits i ON i.inhparent = parent.indexrelid
  JOIN pg_index child ON child.indexrelid = i.inhrelid
 WHERE parent.indexrelid = ANY($1::regclass[])
 ORDER BY 1, 2
"""


async def test_the_audit_indexes_reach_every_partition_even_after_an_interruption(empty_database_url: str) -> None:
    """0008 on a partitioned log with rows and several days: each index on every day's
    partition and the legacy one, valid; run again after a stop half-way (one parent
    made, a partition's build left invalid), it completes; a day made later has them."""
    url = empty_database_url
    await migrate.upgrade_async(url, "0007")
    await populate(url)
    script = ScriptDirectory.from_config(migrate.alembic_config()).get_revision("0008")
    assert script is not None and script.module is not None
    names = list(script.module.INDEXES)
    connection = await asyncpg.connect(asyncpg_dsn(url))
    try:
        await ensure_days(connection, [date(2030, 1, 1)])
        days = sorted(p.name for p in await partitions(connection, "request_events"))
        assert len(days) >= 5  # the legacy partition, the migration's three days, 2030-01-01
        # stopped half-way: the first parent made, one partition's build cancelled (invalid)
        trace_idx, (_, definition) = next(iter(script.module.INDEXES.items()))
        await connection.execute(f"CREATE INDEX {trace_idx} ON ONLY request_events {definition}")
        with pytest.raises(asyncpg.UniqueViolationError):
            await connection.execute(
                "CREATE UNIQUE INDEX CONCURRENTLY request_events_legacy_trace_idx ON request_events_legacy (type)"
            )
        await migrate.upgrade_async(url)
        built = await connection.fetch(AUDIT_INDEXES, names)
        assert {(row[0], row[1]) for row in built} == {(name, day) for name in names for day in days}
        assert all(row[3] for row in built)
        assert await populate(url) is None  # appends go on with the indexes
        await ensure_days(connection, [date(2030, 1, 2)])
        made_later = [row for row in await connection.fetch(AUDIT_INDEXES, names) if row[1].endswith("20300102")]
        assert len(made_later) == len(names) and all(row[3] for row in made_later)
        await migrate.downgrade_async(url, "0007")
        assert (
            await connection.fetchval(
                "SELECT count(*) FROM pg_class WHERE relname LIKE ANY($1::text[])",
                [f"request_events%{name.removeprefix('request_events')}" for name in names],
            )
            == 0
        )
    finally:
        await connection.close()


async def test_appends_go_on_while_the_audit_indexes_are_built(empty_database_url: str) -> None:
    """0008 on a live log: a store appending whole requests one event at a time while the
    indexes are built loses nothing, and no append waits for the whole build."""
    url = empty_database_url
    await migrate.upgrade_async(url, "0007")
    store = await PostgresEventStore.connect(url)
    built = asyncio.Event()
    done: list[traces.Trace] = []
    waits: list[float] = []

    async def appender(lane: int) -> None:
        number = 0
        while not built.is_set() or number < 3:
            trace = traces.completed(f"req_{lane}_{number}")
            for seq, event in enumerate(trace.events):
                began = asyncio.get_running_loop().time()
                await store.append(trace.request_id, seq, [event], durable=True)
                waits.append(asyncio.get_running_loop().time() - began)
            done.append(trace)
            number += 1

    try:
        for number in range(200):  # rows for the builds to read
            trace = traces.completed(f"req_before_{number}")
            await store.append(trace.request_id, 0, trace.events)
        appenders = asyncio.gather(*(appender(lane) for lane in range(4)))
        await asyncio.sleep(0.2)
        began = asyncio.get_running_loop().time()
        await migrate.upgrade_async(url, "0008")
        took = asyncio.get_running_loop().time() - began
        built.set()
        await appenders
        for trace in done:
            assert await store.read(trace.request_id) == trace.events
    finally:
        await store.close()
    assert await migrate.current_revision_async(url) == "0008"
    assert len(done) > 12 and max(waits) < took


GENERATED = """
SELECT 'requests' AS table_name, request_id || '/' AS row_key, first_delta_sent::text AS value FROM requests
UNION ALL SELECT 'request_attempts', request_id || '/' || attempt, ended FROM request_attempts
ORDER BY 1, 2
"""
KINDS = """
SELECT attrelid::regclass::text, attgenerated::text FROM pg_attribute
 WHERE attname IN ('first_delta_sent', 'ended') AND attrelid IN ('requests'::regclass, 'request_attempts'::regclass)
"""


async def test_the_generated_columns_read_the_same_computed_on_read(empty_database_url: str) -> None:
    """0011: ``first_delta_sent`` and ``ended`` computed when read (PostgreSQL 18), the same
    values before and after, and on rows projected since."""
    url = empty_database_url
    await migrate.upgrade_async(url, "0010")
    await populate(url)  # req_2 is still in flight
    connection = await asyncpg.connect(asyncpg_dsn(url))
    try:
        stored = await connection.fetch(GENERATED)
        assert dict(await connection.fetch(KINDS)) == {"requests": "s", "request_attempts": "s"}
        await migrate.upgrade_async(url, "0011")
        assert dict(await connection.fetch(KINDS)) == {"requests": "v", "request_attempts": "v"}
        assert await connection.fetch(GENERATED) == stored
        later = traces.fenced_then_retried("req_after")  # projected after: both columns set on the way
        store = await PostgresEventStore.connect(url)
        try:
            await store.append(later.request_id, 0, later.events)
        finally:
            await store.close()
        virtual = await connection.fetch(GENERATED)
        assert [tuple(row) for row in virtual if row[1].startswith("req_after")] == [
            ("request_attempts", "req_after/1", "lease_expired"),
            ("request_attempts", "req_after/2", "completed"),
            ("requests", "req_after/", "true"),
        ]
        await migrate.downgrade_async(url, "0010")
        assert dict(await connection.fetch(KINDS)) == {"requests": "s", "request_attempts": "s"}
        assert await connection.fetch(GENERATED) == virtual
    finally:
        await connection.close()


QUIET_UPGRADE = """
import sys
from app.telemetry.logs import configure
configure(sys.argv[2])
from app.store import migrate
migrate.upgrade(sys.argv[1])
"""


@pytest.mark.parametrize("level", ["info", "debug"])
def test_an_upgrade_says_one_line_and_alembic_its_own_only_at_debug(empty_database_url: str, level: str) -> None:
    root = Path(__file__).resolve().parents[3]
    done = subprocess.run(
        [sys.executable, "-c", QUIET_UPGRADE, empty_database_url, level],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(root)},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    head = ScriptDirectory.from_config(migrate.alembic_config()).get_current_head()
    said = [line for line in lines if "phasegate.store.migrate" in line]
    assert len(said) == 1 and said[0].endswith(f"the log's schema migrated from revision none to {head}"), lines
    alembic = [line for line in lines if " alembic." in line]
    assert (alembic == []) if level == "info" else len(alembic) > 5, lines
