"""The gauges of a gateway's live state, read off a live gateway's ``/metrics`` scrape.

Real sim workers, a real gateway, real PostgreSQL; the figures are judged by what the
scrape says while the state they describe holds: open requests by phase (and the oldest
one's age) while a request waits in prefill and another streams, healthy replicas per
model once a worker is killed, and the retry budget as retries spend it and one is refused.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import ExitStack

import httpx
from prometheus_client.parser import text_string_to_metric_families

from app.config import Timeouts
from tests.app.conftest import add_fault
from tests.app.driver.test_real_paths import TIMEOUTS, body, post, reject_every_first_attempt
from tests.support.gateway import MODEL, RunningGateway, running_gateway
from tests.support.workers import WorkerProcess, running_worker

# slow enough that a stream is still running when the test scrapes; prefill held by a fault
SLOW = ["--sim-decode-ms-per-token", "100", "--model", MODEL, "--heartbeat-ms", "100"]
PATIENT = Timeouts(first_token_soft_s=20.0, first_token_hard_s=30.0)


def scrape(gateway: RunningGateway) -> dict[str, float]:
    """Every sample of ``/metrics``, by ``name{label="value",...}`` (labels sorted)."""
    with gateway.http() as http:
        response = http.get("/metrics")
    assert response.status_code == 200
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = ",".join(f'{key}="{value}"' for key, value in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}"] = sample.value
    return samples


def open_by_phase(samples: dict[str, float]) -> dict[str, float]:
    return {phase: samples[f'phasegate_requests_open{{phase="{phase}"}}'] for phase in ("prefill", "decode", "fenced")}


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout}s: {what}"
        time.sleep(0.05)


def test_open_requests_by_phase_and_healthy_replicas_follow_the_live_state(
    database_url: str, unique_prompt: Callable[[str], str]
) -> None:
    held = unique_prompt("held in prefill")
    with ExitStack() as stack:
        workers: list[WorkerProcess] = [
            stack.enter_context(running_worker(faults=True, args=[*SLOW, "--worker-id", f"w{n}"])) for n in (1, 2)
        ]
        for worker in workers:
            add_fault(worker, action="slow_prefill", prefill_ms=4000, match={"prompt_contains": held})
        gateway = stack.enter_context(running_gateway(database_url, workers, timeouts=PATIENT))
        idle = scrape(gateway)
        assert open_by_phase(idle) == {"prefill": 0, "decode": 0, "fenced": 0}
        assert idle["phasegate_requests_oldest_open_seconds{}"] == 0
        assert idle[f'phasegate_model_replicas_healthy{{model="{MODEL}"}}'] == 2

        waiting = threading.Thread(target=post, args=(gateway, body(held)))
        waiting.start()
        wait_for(lambda: open_by_phase(scrape(gateway))["prefill"] == 1, 10, "the held request in prefill")
        streamed = {**body(unique_prompt("streams")), "max_tokens": 30, "stream": True}
        with gateway.http() as http, http.stream("POST", "/v1/chat/completions", json=streamed) as stream:
            lines = stream.iter_lines()
            assert any('"content"' in line for line in lines)  # the first delta arrived: decode
            during = scrape(gateway)
            assert open_by_phase(during) == {"prefill": 1, "decode": 1, "fenced": 0}
            assert during["phasegate_requests_oldest_open_seconds{}"] > 0.0
            assert during["phasegate_requests_in_flight{}"] == 2
            assert "data: [DONE]" in list(lines)
        waiting.join(30)
        assert not waiting.is_alive()
        gateway.settle()
        after = scrape(gateway)
        assert open_by_phase(after) == {"prefill": 0, "decode": 0, "fenced": 0}
        assert after["phasegate_requests_oldest_open_seconds{}"] == 0

        # a killed worker leaves the pool once its probes fail: one replica of the model is left
        workers[0].kill()
        healthy = f'phasegate_model_replicas_healthy{{model="{MODEL}"}}'
        wait_for(lambda: scrape(gateway)[healthy] == 1, 15, "the killed worker ejected")
        assert scrape(gateway)['phasegate_replica_healthy{replica="w1"}'] == 0
        workers[1].kill()
        wait_for(lambda: scrape(gateway)[healthy] == 0, 15, "both workers ejected")


def test_the_retry_budget_gauge_and_its_denials(
    database_url: str, sim_pair: list[WorkerProcess], unique_prompt: Callable[[str], str]
) -> None:
    """Two retries in the bucket, refilled far too slowly to matter: two requests whose
    attempt 1 is refused spend them; the third's retry is denied."""
    marker = unique_prompt("budget")
    reject_every_first_attempt(sim_pair, marker)
    try:
        with running_gateway(
            database_url, sim_pair, timeouts=TIMEOUTS, retry_budget_burst=2, retry_budget_per_s=0.0001
        ) as gateway:
            full = scrape(gateway)
            assert 2.0 <= full["phasegate_retry_budget_available{}"] < 2.01
            assert full["phasegate_retry_budget_denied_total{}"] == 0
            assert post(gateway, body(f"{marker} one"))[0] == 200
            one_spent = scrape(gateway)
            assert 1.0 <= one_spent["phasegate_retry_budget_available{}"] < 1.01
            assert post(gateway, body(f"{marker} two"))[0] == 200
            assert post(gateway, body(f"{marker} three"))[0] == 503  # retry_budget_exhausted
            spent = scrape(gateway)
            assert spent["phasegate_retry_budget_available{}"] < 0.01
            assert spent["phasegate_retry_budget_denied_total{}"] == 1
            assert spent['phasegate_migration_total{migration_type="new_request",model="sim"}'] == 2
    finally:
        for worker in sim_pair:
            httpx.delete(worker.base_url + "/admin/faults", timeout=5).raise_for_status()
