"""A request log with one incident of each kind the runbook covers, recorded by driving real
gateways through the faults (as tests/traces/record.py records its traces).

Four sim workers (faults on, each behind a TCP proxy) serve a gateway on the test's
database; each scene scripts one fault and runs a request through it with a real client:

- partition: the link to the worker holding attempt 1 is cut in prefill (fenced, lease
  expired, retried on another);
- overload: the replica refuses attempt 1 (queue full) and a gateway whose retry budget
  is spent cannot retry (``retry_budget_exhausted``);
- client gone: the client hangs up mid-answer;
- gateway lost: a ``phasegate serve`` process is SIGKILLed mid-stream and another
  instance on the same PostgreSQL sweeps it (``gateway_lost``);
- replica dead: a worker dies in prefill (retried, invisible) and one dies after the
  first delta (``upstream_decode_interrupted``);
- poison request: a prompt that kills every replica it reaches, until ``max_attempts``;
- log outage: PostgreSQL stops under a stream (``event_log_unavailable``), then returns.

:func:`record_incidents` returns the request id of each kind's incident.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.config import ReplicaConfig, Timeouts
from app.driver import recorder
from app.store.embedded import EmbeddedPostgres
from ops.processes import phasegate, start_serving, stop, wait_http
from tests.support.gateway import MODEL, RunningGateway, running_gateway
from tests.support.tcp_proxy import TcpProxy, tcp_proxy
from tests.support.transcript import Transcript, stream_chat
from tests.support.workers import WorkerProcess, running_worker

TIMEOUTS = Timeouts(stall_s=1.0, lease_ttl_s=1.5, cancel_ack_s=0.5, first_token_soft_s=10.0, first_token_hard_s=20.0)
SIM_ARGS = ["--model", MODEL, "--heartbeat-ms", "100", "--sim-decode-ms-per-token", "10"]
KINDS = ("replica dead", "partition", "overload", "client gone", "gateway lost", "log outage", "poison request")


def body(prompt: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 10, "seed": 7, **extra}


def fault(workers: list[WorkerProcess], prompt: str, attempt: int | None = 1, **spec: Any) -> None:
    match: dict[str, Any] = {"prompt_contains": prompt}
    if attempt is not None:
        match["attempt"] = attempt
    for worker in workers:
        if worker.proc.poll() is None:
            httpx.post(worker.base_url + "/admin/faults", json={**spec, "match": match}, timeout=5).raise_for_status()


def holding(workers: list[WorkerProcess], timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for index, worker in enumerate(workers):
            if (
                worker.proc.poll() is None
                and httpx.get(worker.base_url + "/admin/attempts", timeout=5).json()["attempts"]
            ):
                return index
        time.sleep(0.01)
    raise AssertionError("no worker received the attempt")


def partition(gateway: RunningGateway, workers: list[WorkerProcess], proxies: list[TcpProxy]) -> str:
    prompt = "runbook: partition"
    fault(workers, prompt, action="slow_prefill", prefill_ms=4000)
    cutter = threading.Thread(target=lambda: proxies[holding(workers)].blackhole(), daemon=True)
    cutter.start()
    transcript = stream_chat(gateway.url, body(prompt))
    cutter.join(10)
    for proxy in proxies:
        proxy.restore()
    assert transcript.done and transcript.error is None, transcript.error
    return transcript.request_id


def overload(database_url: str, workers: list[WorkerProcess], proxies: list[TcpProxy]) -> str:
    prompt = "runbook: overload"
    fault(workers, prompt, action="reject", status=429)
    replicas = [ReplicaConfig(id=f"r{n}", url=p.url) for n, p in enumerate(proxies, start=1)]
    # a gateway whose global retry budget is spent: the retry the policy decides is denied
    with running_gateway(
        database_url, replicas, timeouts=TIMEOUTS, retry_budget_burst=0, retry_budget_per_s=0.001
    ) as spent:
        transcript = stream_chat(spent.url, body(prompt))
        spent.settle()
    assert transcript.error is not None and transcript.error["code"] == "retry_budget_exhausted", transcript.error
    return transcript.request_id


def client_gone(gateway: RunningGateway) -> str:
    transcript = stream_chat(gateway.url, body("runbook: client gone", max_tokens=400), on_delta=lambda n: n >= 3)
    return transcript.request_id


def gateway_lost(database_url: str, workers: list[WorkerProcess], tmp_path: Path) -> str:
    """Two ``phasegate serve`` processes on the log; the one serving a stream is SIGKILLed."""
    config = tmp_path / "instances.toml"
    config.write_text("instance_lease_ttl_s = 2.0\nsweep_interval_s = 0.5\n")
    live = [w for w in workers if w.proc.poll() is None]
    urls = []
    processes = []
    try:
        for n in (1, 2):
            command = phasegate("serve", "--processes", "1", "--config", str(config))
            command += ["--model", f"{MODEL}=rev"]
            command += [arg for i, w in enumerate(live, 1) for arg in ("--replica", f"worker={w.base_url}#r{i}")]
            process, url = start_serving(command, {"DATABASE_URL": database_url}, tmp_path / f"gateway-{n}.log")
            processes.append(process)
            urls.append(url)
        for url in urls:
            wait_http(url + "/readyz")
        seen = threading.Event()
        request_ids: list[str] = []

        def read() -> None:  # until the gateway dies under it
            payload = {**body("runbook: gateway lost", max_tokens=400), "stream": True}
            with (
                contextlib.suppress(httpx.HTTPError),
                httpx.Client(base_url=urls[0], timeout=30) as http,
                http.stream("POST", "/v1/chat/completions", json=payload) as response,
            ):
                request_ids.append(response.headers["x-request-id"])
                for line in response.iter_lines():
                    if line.startswith("data:"):
                        seen.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        assert seen.wait(30)
        stop(processes[0], signal.SIGKILL)
        reader.join(30)
        (request_id,) = request_ids
        wait_until(lambda: _swept(database_url, request_id), 30, "the survivor to sweep the dead instance")
        return request_id
    finally:
        for process in processes:
            stop(process, signal.SIGTERM)


def _swept(database_url: str, request_id: str) -> bool:
    from tests.support.audit import read_model_row

    return read_model_row(database_url, request_id).get("error_code") == "gateway_lost"


def replica_dead(gateway: RunningGateway, workers: list[WorkerProcess]) -> tuple[str, str]:
    """(a request retried after its replica died in prefill, one cut after its first delta)."""
    prompt = "runbook: replica dead in prefill"
    fault(workers, prompt, action="die", point="before_frame", at_token=0)
    retried = stream_chat(gateway.url, body(prompt))
    assert retried.done and retried.error is None, retried.error
    without_the_dead(gateway, workers)
    prompt = "runbook: replica dead in decode"
    fault(workers, prompt, action="die", point="after_frame", at_token=2)
    cut = stream_chat(gateway.url, body(prompt))
    assert cut.error is not None and cut.error["code"] == "upstream_decode_interrupted", cut.error
    return retried.request_id, cut.request_id


def without_the_dead(gateway: RunningGateway, workers: list[WorkerProcess]) -> None:
    """Wait until the pool no longer offers a replica whose worker died (probes eject it)."""
    pool = gateway.gateway.ctx.pool
    dead = {f"r{n}" for n, worker in enumerate(workers, start=1) if worker.proc.poll() is not None}
    wait_until(lambda: not any(pool.available(pool.replicas[r]) for r in dead), 20, "the dead replicas' ejection")


def poison(gateway: RunningGateway, workers: list[WorkerProcess]) -> str:
    without_the_dead(gateway, workers)
    prompt = "runbook: poison"
    fault(workers, prompt, attempt=None, action="die", point="before_frame", at_token=0)
    transcript = stream_chat(gateway.url, body(prompt))
    assert transcript.error is not None, "the poison request was answered"
    return transcript.request_id


def log_outage(database_url: str, postgres_server: EmbeddedPostgres | None, monkeypatch: pytest.MonkeyPatch) -> str:
    """PostgreSQL stops under a stream longer than a durable append waits, then comes back."""
    if postgres_server is None:
        pytest.skip("needs the embedded server (PHASEGATE_TEST_DATABASE_URL names an outside one)")
    monkeypatch.setattr(recorder, "STORE_OUTAGE_GRACE_S", 0.5)
    with (
        running_worker(args=["--model", MODEL, "--sim-decode-ms-per-token", "15"]) as worker,
        running_gateway(database_url, [worker]) as gateway,
    ):
        seen = threading.Event()
        result: list[Transcript] = []
        reader = threading.Thread(
            target=lambda: result.append(
                stream_chat(
                    gateway.url, body("runbook: log outage", max_tokens=60), on_delta=lambda n: n >= 3 and seen.set()
                )
            ),
            daemon=True,
        )
        reader.start()
        assert seen.wait(30)
        postgres_server.stop(mode="fast")
        try:
            reader.join(30)
        finally:
            postgres_server.start()
        (transcript,) = result
        assert transcript.error is not None and transcript.error["code"] == "event_log_unavailable", transcript.error
        wait_until(
            lambda: bool(gateway.events(transcript.request_id)[-1:]) and _closed(gateway, transcript), 30, "the close"
        )
        gateway.settle()
        return transcript.request_id


def _closed(gateway: RunningGateway, transcript: Transcript) -> bool:
    from statemachine.state import fold

    return fold(gateway.events(transcript.request_id)).outcome is not None


def wait_until(condition: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.1)


def record_incidents(
    database_url: str,
    postgres_server: EmbeddedPostgres | None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> dict[str, str]:
    """Drive each incident through real gateways onto ``database_url``: kind -> request id."""
    incidents: dict[str, str] = {}
    with ExitStack() as stack:
        workers = [
            stack.enter_context(running_worker(faults=True, args=[*SIM_ARGS, "--worker-id", f"r{n}"]))
            for n in (1, 2, 3, 4)
        ]
        proxies = [stack.enter_context(tcp_proxy(worker.base_url)) for worker in workers]
        for proxy in proxies:
            stack.callback(proxy.restore)
        replicas = [ReplicaConfig(id=f"r{n}", url=p.url) for n, p in enumerate(proxies, start=1)]
        # the client that leaves gets a short grace: its 400 tokens take 4 s, the grace runs out first
        gateway = stack.enter_context(
            running_gateway(database_url, replicas, timeouts=TIMEOUTS, health_interval_s=0.5, resume_grace_s=0.5)
        )
        incidents["partition"] = partition(gateway, workers, proxies)
        incidents["overload"] = overload(database_url, workers, proxies)
        incidents["client gone"] = client_gone(gateway)
        incidents["gateway lost"] = gateway_lost(database_url, workers, tmp_path)
        incidents["replica dead"], incidents["replica dead, after the first delta"] = replica_dead(gateway, workers)
        incidents["poison request"] = poison(gateway, workers)
        gateway.settle()
    incidents["log outage"] = log_outage(database_url, postgres_server, monkeypatch)
    return incidents
