"""PostgreSQL goes away under the store, then comes back: typed errors, then recovery."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

import pytest

from app.store import PostgresEventStore, StoreUnavailable
from app.store.embedded import EmbeddedPostgres
from ops import traces
from tests.support.waiting import until

T = TypeVar("T")


@pytest.fixture
def server(postgres_server: EmbeddedPostgres | None, database_url: str) -> Iterator[EmbeddedPostgres]:
    """The session's embedded server, restarted after the test whatever it did to it.

    It depends on ``database_url`` so that the restart comes before that database is dropped.
    """
    if postgres_server is None:
        pytest.skip("needs the embedded server (PHASEGATE_TEST_DATABASE_URL is set)")
    try:
        yield postgres_server
    finally:
        if not postgres_server.is_running():
            postgres_server.start()


async def test_an_outage_gives_typed_errors_then_the_store_recovers(
    server: EmbeddedPostgres, database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="phasegate.store")
    store = await PostgresEventStore.connect(database_url, flush_delay=60.0)
    queued, durable = traces.completed("req_queued"), traces.completed("req_durable")
    try:
        await store.append("req_durable", 0, durable.events[:3])
        await store.append("req_queued", 0, queued.events[:6], durable=False)  # acknowledged, not yet written
        server.stop(mode="immediate")

        with pytest.raises(StoreUnavailable):
            await store.append("req_durable", 3, durable.events[3:5])  # takes the queued ones along
        with pytest.raises(StoreUnavailable):
            await store.append("req_durable", 3, durable.events[3:5], durable=False)  # fails fast meanwhile
        with pytest.raises(StoreUnavailable):
            await store.read("req_durable")
        with pytest.raises(StoreUnavailable):
            await store.ping()  # what /readyz asks
        assert not store.accepting  # what a new request's acceptance looks at

        server.start()
        await until(lambda: store.writer.available)
        await store.ping()
        assert store.accepting
        await store.append("req_durable", 3, durable.events[3:])  # the caller's retry
        await store.append("req_queued", 6, queued.events[6:])
        assert await store.read("req_durable") == durable.events
        assert await store.read("req_queued") == queued.events  # nothing acknowledged was lost
    finally:
        await store.close()
    logged = caplog.text
    assert "PostgreSQL unavailable" in logged
    assert "PostgreSQL available again" in logged


async def test_close_reports_what_an_outage_kept_it_from_writing(server: EmbeddedPostgres, database_url: str) -> None:
    store = await PostgresEventStore.connect(database_url, flush_delay=60.0)
    trace = traces.completed("req_lost")
    await store.append("req_lost", 0, trace.events[:3])
    await store.append("req_lost", 3, trace.events[3:], durable=False)
    server.stop(mode="immediate")
    with pytest.raises(StoreUnavailable, match=f"{len(trace.events) - 3} accepted events"):
        await store.writer.close(timeout=1.0)
    await store.close()


async def test_connecting_while_postgresql_is_down_is_a_typed_error(tmp_path: object) -> None:
    with pytest.raises(StoreUnavailable):
        await PostgresEventStore.connect(f"postgresql+asyncpg://postgres@/postgres?host={tmp_path}")


async def test_a_restart_under_load_loses_nothing_acknowledged(server: EmbeddedPostgres, database_url: str) -> None:
    store = await PostgresEventStore.connect(database_url, flush_delay=0.002)
    scenario = [traces.completed(f"req_{n}", texts=tuple(f"t{i}" for i in range(150))) for n in range(20)]
    outages = 0

    async def drive(trace: traces.Trace) -> None:
        nonlocal outages
        for seq, event in enumerate(trace.events):
            durable = seq < 5 or seq == len(trace.events) - 1  # the commit point and the terminal event
            while True:
                try:
                    await store.append(trace.request_id, seq, [event], durable=durable)
                    break
                except StoreUnavailable:  # retrying the same event is safe, recorded or not
                    outages += 1
                    await asyncio.sleep(0.05)
            await asyncio.sleep(0.003)

    try:
        driving = asyncio.gather(*(drive(trace) for trace in scenario))
        await asyncio.sleep(0.1)
        await asyncio.to_thread(server.restart)
        await asyncio.wait_for(driving, 60)
        await store.flush()
        for trace in scenario:
            assert await store.read(trace.request_id) == trace.events
    finally:
        await store.close()
    assert outages > 0  # the restart did land in the middle of the load


async def retried(call: Callable[[], Awaitable[T]], timeout: float = 15.0) -> T:
    """``call()`` again while the store is unavailable, as a caller of the store does."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await call()
        except StoreUnavailable:
            assert time.monotonic() < deadline, "the store stayed unavailable"
            await asyncio.sleep(0.05)


async def test_a_server_refusing_writes_as_read_only_is_an_outage_until_it_takes_them(database_url: str) -> None:
    """A connection that ends up on a server that is no primary (a demoted one, or a
    standby behind a stale address) gets SQLSTATE 25006 for every write: the store calls
    that unavailable, drops those connections and reconnects until a server takes writes."""
    import asyncpg

    from app.store.database import asyncpg_dsn

    admin = await asyncpg.connect(asyncpg_dsn(database_url))
    store = await PostgresEventStore.connect(database_url, flush_delay=0.002)
    trace = traces.completed("req_read_only")

    async def demote(read_only: bool) -> None:
        """New sessions refuse writes (as a standby's do) or take them again; demoting
        also drops every open session, as a primary's restart as a standby does."""
        name = await admin.fetchval("SELECT current_database()")
        setting = "on" if read_only else "off"
        await admin.execute(f'ALTER DATABASE "{name}" SET default_transaction_read_only = {setting}')
        if read_only:
            await admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )

    try:
        await store.append("req_read_only", 0, trace.events[:3])
        await store.claim_tool_execution("req_read_only:call_0", "req_read_only", 1, "call_0", "f", "{}")
        await demote(read_only=True)
        for _ in range(2):  # the dropped connection first, then one to a server that refuses writes
            with pytest.raises(StoreUnavailable):
                await store.append("req_read_only", 3, trace.events[3:5])
            with pytest.raises(StoreUnavailable):
                await store.claim_tool_execution("req_read_only:call_1", "req_read_only", 1, "call_1", "f", "{}")
        assert await store.read("req_read_only") == trace.events[:3]  # reads still work on it
        await demote(read_only=False)  # the store's open sessions still refuse: it must drop them itself
        await retried(lambda: store.append("req_read_only", 3, trace.events[3:]))
        assert await retried(
            lambda: store.claim_tool_execution("req_read_only:call_1", "req_read_only", 1, "call_1", "f", "{}")
        )
        assert await store.read("req_read_only") == trace.events
    finally:
        await demote(read_only=False)
        await admin.close()
        await store.close()
