"""Analysts' read-only role with row-level security by tenant (docs/design.md §13, migration 0006):
real roles created in the test server, connected as, seeing only their tenants' rows."""

from __future__ import annotations

import itertools
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import asyncpg
import pytest
from sqlalchemy.engine import make_url

from app.store import PostgresEventStore
from app.store.database import asyncpg_dsn
from ops import traces

LOG_TABLES = ("requests", "request_attempts", "request_events", "tool_executions", "request_inputs")
_names = itertools.count(1)


def role_name(what: str) -> str:
    return f"{what}_{os.getpid()}_{next(_names)}"  # roles are the whole server's: unique per test


async def populate(url: str) -> None:
    store = await PostgresEventStore.connect(url)
    try:
        for request_id, tenant in (("req_a1", "team-a"), ("req_a2", "team-a"), ("req_b1", "team-b")):
            trace = traces.completed(request_id, tenant=tenant)
            await store.append(request_id, 0, trace.events)
            await store.claim_tool_execution(f"{request_id}:call_1", request_id, 1, "call_1", "f", "{}")
            await store.record_input(request_id, {"messages": [{"role": "user", "content": tenant}]})
    finally:
        await store.close()


@dataclass
class Owner:
    """The tables' owner's connection (the gateway's role), and the roles a test made."""

    connection: asyncpg.Connection
    roles: list[str] = field(default_factory=list)

    async def execute(self, statement: str, *args: object) -> None:
        await self.connection.execute(statement, *args)

    async def fetchval(self, query: str) -> object:
        return await self.connection.fetchval(query)


@pytest.fixture
async def owner(database_url: str) -> AsyncIterator[Owner]:
    await populate(database_url)
    made = Owner(await asyncpg.connect(asyncpg_dsn(database_url)))
    try:
        yield made
    finally:
        for role in made.roles:
            await made.execute(f'DROP OWNED BY "{role}"')
            await made.execute(f'DROP ROLE "{role}"')
        await made.connection.close()


async def make_role(owner: Owner, name: str, *, login: bool, member_of: tuple[str, ...] = ()) -> str:
    await owner.execute(f'CREATE ROLE "{name}" {"LOGIN" if login else "NOLOGIN"}')
    owner.roles.insert(0, name)  # members first: dropped before their groups
    for group in member_of:
        await owner.execute(f'GRANT "{group}" TO "{name}"')
    return name


async def bind(owner: Owner, role: str, tenant: str) -> None:
    await owner.execute("INSERT INTO analyst_tenants (role_name, tenant) VALUES ($1, $2)", role, tenant)


async def connect_as(database_url: str, role: str) -> asyncpg.Connection:
    return await asyncpg.connect(asyncpg_dsn(make_url(database_url).set(username=role).render_as_string(False)))


async def visible(connection: asyncpg.Connection) -> dict[str, set[str]]:
    return {
        table: {row[0] for row in await connection.fetch(f"SELECT request_id FROM {table}")} for table in LOG_TABLES
    }


async def test_an_analyst_sees_only_its_tenants_rows_in_every_table(database_url: str, owner: Owner) -> None:
    analyst = await make_role(owner, role_name("analyst"), login=True, member_of=("phasegate_analysts",))
    await bind(owner, analyst, "team-a")
    connection = await connect_as(database_url, analyst)
    try:
        seen = await visible(connection)
        assert seen == {table: {"req_a1", "req_a2"} for table in LOG_TABLES}
        assert await connection.fetchval("SELECT count(*) FROM request_events WHERE request_id = 'req_b1'") == 0
        await bind(owner, analyst, "team-b")  # a second binding: both tenants, at once
        assert (await visible(connection))["request_events"] == {"req_a1", "req_a2", "req_b1"}
    finally:
        await connection.close()


async def test_a_group_role_binds_its_members_and_an_unbound_analyst_sees_nothing(
    database_url: str, owner: Owner
) -> None:
    readers = await make_role(owner, role_name("team_b_readers"), login=False)
    await bind(owner, readers, "team-b")
    member = await make_role(owner, role_name("bob"), login=True, member_of=("phasegate_analysts", readers))
    unbound = await make_role(owner, role_name("carol"), login=True, member_of=("phasegate_analysts",))
    await bind(owner, role_name("dropped_role"), "team-a")  # names no role: ignored, not an error
    as_member = await connect_as(database_url, member)
    as_unbound = await connect_as(database_url, unbound)
    try:
        assert await visible(as_member) == {table: {"req_b1"} for table in LOG_TABLES}
        assert await visible(as_unbound) == {table: set() for table in LOG_TABLES}
        await as_unbound.execute("SET ROLE phasegate_analysts")  # the group itself is bound to nothing
        assert await visible(as_unbound) == {table: set() for table in LOG_TABLES}
    finally:
        await as_member.close()
        await as_unbound.close()


async def test_the_analysts_role_is_read_only_and_sees_no_keys(database_url: str, owner: Owner) -> None:
    analyst = await make_role(owner, role_name("analyst"), login=True, member_of=("phasegate_analysts",))
    await bind(owner, analyst, "team-a")
    await bind(owner, role_name("someone_else"), "team-b")
    connection = await connect_as(database_url, analyst)
    try:
        for statement in (
            "DELETE FROM request_events",
            "UPDATE requests SET outcome = 'completed'",
            "INSERT INTO analyst_tenants VALUES ('x', 'team-b')",
            "SELECT * FROM api_keys",
            "SELECT * FROM gateway_instances",
        ):
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await connection.execute(statement)
        bindings = await connection.fetch("SELECT role_name, tenant FROM analyst_tenants")
        assert [tuple(row) for row in bindings] == [(analyst, "team-a")]  # its own, no one else's
    finally:
        await connection.close()
    # the owner (the gateway's role) is not held back by row-level security
    assert await owner.fetchval("SELECT count(DISTINCT request_id) FROM request_events") == 3
