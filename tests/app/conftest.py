"""Gateway fixtures: real sim workers (faults enabled) and a real gateway over them.

- ``sim_pair`` (module): two sim workers, ``w1`` and ``w2``, 3 ms a token, faults on.
  A test that kills one gets its own pair from ``fresh_pair`` instead.
- ``gateway`` (function): a gateway on a fresh database over ``sim_pair``.
- ``add_fault(worker, **spec)``: script a fault on one worker (docs/worker-protocol.md).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest

from tests.support.gateway import RunningGateway, running_gateway
from tests.support.workers import WorkerProcess, running_worker

SIM_ARGS = ["--sim-decode-ms-per-token", "3", "--model", "sim", "--heartbeat-ms", "100", "--max-model-len", "512"]


def start_pair(stack: ExitStack, extra: list[str] | None = None) -> list[WorkerProcess]:
    return [
        stack.enter_context(running_worker(faults=True, args=[*SIM_ARGS, "--worker-id", f"w{n}", *(extra or [])]))
        for n in (1, 2)
    ]


@pytest.fixture(scope="module")
def sim_pair() -> Iterator[list[WorkerProcess]]:
    with ExitStack() as stack:
        workers = start_pair(stack)
        yield workers
        for worker in workers:
            httpx.delete(worker.base_url + "/admin/faults")


@pytest.fixture
def fresh_pair() -> Iterator[list[WorkerProcess]]:
    with ExitStack() as stack:
        yield start_pair(stack)


@pytest.fixture
def gateway(database_url: str, sim_pair: list[WorkerProcess]) -> Iterator[RunningGateway]:
    for worker in sim_pair:
        httpx.delete(worker.base_url + "/admin/faults")
    # a client that leaves is cancelled at once here (the grace has its own tests)
    with running_gateway(database_url, sim_pair, resume_grace_s=0) as running:
        yield running


def add_fault(worker: WorkerProcess, **spec: Any) -> None:
    response = httpx.post(worker.base_url + "/admin/faults", json=spec, timeout=5)
    assert response.status_code == 200, response.text


@pytest.fixture
def unique_prompt() -> Callable[[str], str]:
    """A prompt no other test uses, so a fault can match it alone."""
    return lambda words="": f"{words} {uuid.uuid4().hex[:12]}".strip()
