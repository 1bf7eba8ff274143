"""Workers for the protocol suite: one per engine, shared; sim ones per test where needed."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from app.replicas.worker_client import WorkerClient
from tests.app.worker.engines import ENGINES, SLOTS, EngineUnderTest, start_sim_engine, vllm_engine
from tests.support.workers import WorkerProcess, running_worker


@pytest.fixture(scope="session", params=ENGINES)
def engine(request: pytest.FixtureRequest) -> Iterator[EngineUnderTest]:
    """A shared worker per engine (sim, and the run's vLLM worker where available), faults enabled."""
    if request.param == "vllm":
        yield vllm_engine(request.getfixturevalue("vllm"))
        return
    under_test = start_sim_engine()
    try:
        yield under_test
    finally:
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
