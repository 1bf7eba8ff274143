"""The differential suite's targets: the run's shared ``vllm serve`` directly, and a real
phasegate gateway in front of it as an ``openai`` replica or in front of the run's shared
vLLM worker (``phasegate worker --engine vllm``, the same model, engine arguments and
parsers) as a ``worker`` replica (tests/support/vllm_replicas.py).

Every test here is marked ``vllm``: one process runs them with the other vLLM tests, one
request at a time, on the same engine arguments.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from app.config import ReplicaConfig, Timeouts
from tests.compat.compare import Answer, ask, differences
from tests.support.gateway import RunningGateway, running_gateway
from tests.support.vllm_replicas import MODEL, SharedVllm

# What is compared here is the answer, not the deadlines: a loaded machine (four vLLM
# engines starting at the run's start) can keep vLLM from answering within the defaults,
# and a request that found no replica in time would differ from vLLM's answer (CI)
PATIENT = Timeouts(
    lease_ttl_s=30.0,
    stall_s=30.0,
    first_token_hard_s=180.0,
    openai_first_token_s=120.0,
    connect_s=30.0,
    upstream_response_s=120.0,
)


@pytest.fixture(scope="package")
def through_gateway(package_database_url: str, vllm: SharedVllm) -> Iterator[RunningGateway]:
    replicas = [ReplicaConfig(id="vllm-serve", url=vllm.server_url, kind="openai")]
    with running_gateway(
        package_database_url, replicas, models={MODEL: "compat"}, health_interval_s=30, timeouts=PATIENT
    ) as gateway:
        yield gateway


@pytest.fixture(scope="package")
def through_worker(package_database_url: str, vllm: SharedVllm) -> Iterator[RunningGateway]:
    replicas = [ReplicaConfig(id="vllm-worker", url=vllm.worker().base_url, kind="worker")]
    with running_gateway(
        package_database_url, replicas, models={MODEL: "compat"}, health_interval_s=30, timeouts=PATIENT
    ) as gateway:
        yield gateway


class Pair:
    """Send a request to both targets and compare what a client gets."""

    def __init__(self, vllm: SharedVllm, gateway: RunningGateway) -> None:
        self.direct_url, self.gateway_url = vllm.server_url, gateway.url
        self.http = httpx.Client(timeout=120)

    def both(self, path: str, body: dict[str, object]) -> tuple[Answer, Answer]:
        return ask(self.http, self.direct_url, path, body), ask(self.http, self.gateway_url, path, body)

    def differences(self, path: str, body: dict[str, object]) -> list[str]:
        return differences(*self.both(path, body))


@pytest.fixture(scope="package")
def pair(vllm: SharedVllm, through_gateway: RunningGateway) -> Iterator[Pair]:
    made = Pair(vllm, through_gateway)
    yield made
    made.http.close()


@pytest.fixture(scope="package")
def worker_pair(vllm: SharedVllm, through_worker: RunningGateway) -> Iterator[Pair]:
    made = Pair(vllm, through_worker)
    yield made
    made.http.close()


@pytest.fixture(params=["openai replica", "worker replica"])
def target(request: pytest.FixtureRequest) -> Pair:
    """``vllm serve`` against phasegate in front of it, then in front of the vLLM worker."""
    pair: Pair = request.getfixturevalue("pair" if request.param == "openai replica" else "worker_pair")
    return pair
