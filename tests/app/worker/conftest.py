"""Workers for the protocol suite: one per engine, shared; sim ones per test where needed."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator

import pytest

from app.replicas.worker_client import WorkerClient
from tests.app.worker.engines import ENGINES, SLOTS, EngineUnderTest, start_engine
from tests.support.workers import WorkerProcess, running_worker


@pytest.fixture(scope="session", params=ENGINES)
def engine(request: pytest.FixtureRequest) -> Iterator[EngineUnderTest]:
    """A shared worker per engine (sim, and vllm where available), faults enabled."""
    under_test = start_engine(request.param)
    try:
        yield under_test
    finally:
        under_test.worker.kill()


@pytest.fixture
def engine_factory() -> Iterator[Callable[[str, list[str]], EngineUnderTest]]:
    """Start a private worker of an engine with extra args (for drain and kill tests)."""
    started: list[EngineUnderTest] = []

    def make(engine_name: str, args: list[str]) -> EngineUnderTest:
        under_test = start_engine(engine_name, args)
        started.append(under_test)
        return under_test

    yield make
    for under_test in started:
        under_test.worker.kill()


@pytest.fixture(scope="module")
def sim_worker() -> Iterator[WorkerProcess]:
    """A shared sim worker with faults enabled, 5 ms per token."""
    with running_worker(faults=True, args=[*SLOTS, "--sim-decode-ms-per-token", "5"]) as worker:
        yield worker


@pytest.fixture
async def client(engine: EngineUnderTest) -> AsyncIterator[WorkerClient]:
    worker_client = engine.worker.client()
    yield worker_client
    await worker_client.aclose()


@pytest.fixture
async def sim_client(sim_worker: WorkerProcess) -> AsyncIterator[WorkerClient]:
    worker_client = sim_worker.client()
    yield worker_client
    await worker_client.aclose()
