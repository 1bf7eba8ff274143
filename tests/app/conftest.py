"""Gateway fixtures: real sim workers (faults enabled) and a real gateway over them.

- ``sim_pair`` (module): two sim workers, ``w1`` and ``w2``, 3 ms a token, faults on.
  A test that kills one gets its own pair from ``fresh_pair`` instead.
- ``gateway`` (function): a gateway on a fresh database over ``sim_pair``.
- ``add_fault(worker, **spec)``: script a fault on one worker (docs/worker-protocol.md).
- ``held(worker, prompt, at_token)``: hold an attempt at a token until the test releases it.
"""

from __future__ import annotations

import contextlib
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


def add_fault(worker: WorkerProcess, **spec: Any) -> int:
    """Register one scripted fault (docs/worker-protocol.md); returns its id."""
    response = httpx.post(worker.base_url + "/admin/faults", json=spec, timeout=5)
    assert response.status_code == 200, response.text
    return int(response.json()["added"][0]["id"])


@contextlib.contextmanager
def held(worker: WorkerProcess, prompt: str, at_token: int) -> Iterator[Callable[..., None]]:
    """A ``hold`` fault on the attempt whose prompt holds ``prompt``: it publishes tokens
    0…k−1, then waits for the release this yields (``release(hold_at=m)``: on to token m,
    held again there), so a test knows the request is still live at the moment it
    chooses. Released on the way out whatever happened."""
    fault_id = add_fault(worker, action="hold", at_token=at_token, match={"prompt_contains": prompt})

    def release(hold_at: int | None = None) -> None:
        body = {} if hold_at is None else {"hold_at": hold_at}
        response = httpx.post(f"{worker.base_url}/admin/faults/{fault_id}/release", json=body, timeout=10)
        assert response.status_code == 200, response.text

    try:
        yield release
    finally:
        with contextlib.suppress(httpx.ConnectError):  # a test that killed the worker
            release()


@pytest.fixture
def unique_prompt() -> Callable[[str], str]:
    """A prompt no other test uses, so a fault can match it alone."""
    return lambda words="": f"{words} {uuid.uuid4().hex[:12]}".strip()
