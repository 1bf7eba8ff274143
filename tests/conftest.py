"""Fixtures for every test. The database ones start PostgreSQL only when a test asks.

PostgreSQL comes from the project's own embedded server (app/store/embedded.py), so
``pytest`` needs nothing installed. Pure tests request none of these and run
without a database.

- ``postgres_server`` (session): the one embedded server of the run, in a temporary
  directory, with fsync off (tests need no crash safety). A test may stop or restart
  it (``postgres_server.restart()``, ``stop(mode="immediate")``) but must leave it
  running. With ``PHASEGATE_TEST_DATABASE_URL`` set, that server is used instead and
  this fixture is ``None``.
- ``admin_url`` (session): URL of the server's ``postgres`` database, for tests that
  create their own databases.
- ``database_url`` (function): URL of a fresh database migrated to head, copied from
  a migrated template (tens of milliseconds), dropped after the test.
- ``package_database_url`` (package): the same, shared by a test package (for a gateway
  process that serves a module's or a package's tests).
- ``empty_database_url`` (function): a fresh database with no schema at all.
- ``event_store`` (function): a ``PostgresEventStore`` on ``database_url``, closed
  (flushed) after the test.
- ``vllm`` (session): the run's one ``vllm serve`` and vLLM worker
  (tests/support/vllm_replicas.py), for tests marked ``vllm``; with a replacement worker
  started meanwhile for each test marked ``ends_vllm_worker`` after the first.

The suite runs in parallel processes (pytest-xdist, ``-n`` in pyproject.toml), each with
its own embedded server; a module, or a named group of modules, is one process's unit of
work (tests/support/scheduling.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import coverage
import hypothesis
import pytest
from sqlalchemy.engine import make_url

from app.store import migrate
from app.store.database import asyncpg_dsn, sqlalchemy_url
from app.store.embedded import EmbeddedPostgres
from app.store.postgres import PostgresEventStore
from tests.support.scheduling import ModuleOrGroupScheduling, make_groups_folder, record_groups, remove_groups_folder
from tests.support.vllm_replicas import SharedVllm, shared_vllm
from tests.support.workers import vllm_env

TEMPLATE = f"phasegate_template_{os.getpid()}"  # two runs may share one server
ENDERS = pytest.StashKey[int]()  # how many of the run's tests end the shared vLLM worker
_names = itertools.count(1)

# Hypothesis's per-example deadline (200 ms) measures the machine, not the code: four
# processes on two cores (and a CI machine's neighbours) stretch one example past it now
# and then. The properties are what the suite holds; speed has its benchmarks (ops/bench/).
hypothesis.settings.register_profile("phasegate", deadline=None)
hypothesis.settings.load_profile("phasegate")


def pytest_configure(config: pytest.Config) -> None:
    if config.pluginmanager.hasplugin("xdist") and not hasattr(config, "workerinput"):
        make_groups_folder()
    coverage = config.pluginmanager.get_plugin("_cov")
    if coverage is not None and partial_run(config):
        # a few tests' coverage of all of app/ reads as a failure: the data is still
        # written (.coverage, `coverage report` shows it); the table is the full run's
        coverage.options.cov_report = {}


def partial_run(config: pytest.Config) -> bool:
    """Whether this run is less than the whole suite: paths other than ``testpaths``, or a selection."""
    given = {Path(arg.split("::")[0]).resolve() for arg in config.args}
    whole = {(config.rootpath / path).resolve() for path in config.getini("testpaths")}
    return given != whole or bool(config.option.keyword) or bool(config.option.markexpr)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    if partial_run(config) and config.pluginmanager.hasplugin("_cov"):
        terminalreporter.write_line("coverage: a partial run prints no table (`coverage report` reads its data)")


def pytest_unconfigure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):
        remove_groups_folder()


# Folders whose tests are ``untraced`` (below): tests of the whole gateway, its faults and its
# deployment, whose app code the tests of tests/app and the processes they start measure
# already; traced, they were a third of the run's CPU (docs/testing.md, "Where the time goes")
UNTRACED_FOLDERS = ("faults", "compat", "ops")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """A test marked ``untraced`` runs with coverage's tracer stopped in this process (its
    threads' too); the processes it starts are measured as ever. pytest-cov's own
    ``no_cover`` marker fails under ``--no-cov``."""
    measuring = coverage.Coverage.current() if item.get_closest_marker("untraced") else None
    if measuring is None:  # not marked, or coverage is off (--no-cov)
        return (yield)
    measuring.stop()
    try:
        return (yield)
    finally:
        measuring.start()


@pytest.hookimpl(trylast=True)  # after pytest ordered the tests by their fixtures
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test that runs vLLM is in one group: one process runs them all, on the run's
    one shared ``vllm serve`` and vLLM worker (tests/support/vllm_replicas.py). Those that
    end that worker run after every other (the replacement each needs is started while the
    others run). A test that runs vLLM's code in a child process of its own (marked
    ``vllm_subprocess``) shares nothing with them: its module is a unit of its own, which
    another process runs meanwhile."""
    tests = Path(__file__).parent
    for item in items:
        if item.path.relative_to(tests).parts[0] in UNTRACED_FOLDERS:
            item.add_marker(pytest.mark.untraced)
    items.sort(key=lambda item: item.get_closest_marker("ends_vllm_worker") is not None)
    config.stash[ENDERS] = sum(item.get_closest_marker("ends_vllm_worker") is not None for item in items)
    record_groups([item for item in items if item.get_closest_marker("vllm_subprocess") is None], {"vllm": "vllm"})


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") not in ("load", "loadgroup"):
        return None  # another --dist asked for by name: xdist's own
    return ModuleOrGroupScheduling(config, log)


def run_sync(coroutine_function: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    """Run a coroutine to completion from synchronous code, on a thread of its own.

    A thread keeps it off the event loop pytest-asyncio manages for the tests.
    """
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine_function()).result()


def url_of(url: str, database: str) -> str:
    return make_url(url).set(database=database).render_as_string(hide_password=False)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[EmbeddedPostgres | None]:
    if os.environ.get("PHASEGATE_TEST_DATABASE_URL"):
        yield None
        return
    data_dir = tempfile.mkdtemp(prefix="phasegate-test-pg-")
    os.chmod(data_dir, 0o755)  # ours: the server's user must be able to enter it
    server = EmbeddedPostgres(data_dir, settings={"fsync": "off", "full_page_writes": "off"})
    server.start()
    server.stop_on_signals()  # a terminated run leaves no server behind
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(data_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def vllm(request: pytest.FixtureRequest) -> Iterator[SharedVllm]:
    # a worker for each test that ends one, but the first: that one ends the worker the others used
    spares = max(0, request.config.stash.get(ENDERS, 0) - 1)
    with shared_vllm(vllm_env(), spare_workers=spares) as shared:
        yield shared


@pytest.fixture(scope="session")
def admin_url(postgres_server: EmbeddedPostgres | None) -> Iterator[str]:
    url = sqlalchemy_url(os.environ["PHASEGATE_TEST_DATABASE_URL"]) if postgres_server is None else postgres_server.url

    async def make_template() -> None:
        await _recreate(url, TEMPLATE)
        await migrate.upgrade_async(url_of(url, TEMPLATE))

    run_sync(make_template)
    yield url
    run_sync(lambda: _drop(url, TEMPLATE))


@pytest.fixture
async def database_url(admin_url: str) -> AsyncIterator[str]:
    name = f"phasegate_test_{os.getpid()}_{next(_names)}"
    await _recreate(admin_url, name, template=TEMPLATE)
    yield url_of(admin_url, name)
    await _drop(admin_url, name)


@pytest.fixture(scope="package")
def package_database_url(admin_url: str) -> Iterator[str]:
    name = f"phasegate_package_{os.getpid()}_{next(_names)}"
    run_sync(lambda: _recreate(admin_url, name, template=TEMPLATE))
    yield url_of(admin_url, name)
    run_sync(lambda: _drop(admin_url, name))


@pytest.fixture
async def empty_database_url(admin_url: str) -> AsyncIterator[str]:
    name = f"phasegate_empty_{os.getpid()}_{next(_names)}"
    await _recreate(admin_url, name)
    yield url_of(admin_url, name)
    await _drop(admin_url, name)


@pytest.fixture
async def event_store(database_url: str) -> AsyncIterator[PostgresEventStore]:
    store = await PostgresEventStore.connect(database_url)
    try:
        yield store
    finally:
        await store.close()


async def _recreate(admin_url: str, name: str, *, template: str | None = None) -> None:
    admin = await asyncpg.connect(asyncpg_dsn(admin_url))
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        copy = f' TEMPLATE "{template}"' if template else ""
        await admin.execute(f'CREATE DATABASE "{name}"{copy}')
    finally:
        await admin.close()


async def _drop(admin_url: str, name: str) -> None:
    admin = await asyncpg.connect(asyncpg_dsn(admin_url))
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()
