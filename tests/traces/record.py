"""Record golden traces from a real gateway into tests/traces/recorded/.

    python -m tests.traces.record [SCENARIO …]

The traces next to this file are written by the pure model that replay then checks
(tests/traces/generate.py); these are not. Each scenario here starts two real sim
workers (faults on, each behind a TCP proxy; two scripted OpenAI-compatible upstreams
for the scenarios of ``OPENAI_SCENARIOS``), a real gateway on a real PostgreSQL
(the embedded server, in a temporary directory), scripts one fault, runs one request
through the gateway with a real client, and exports that request's log with the
same code as ``phasegate trace export`` (``app.incident.trace_io.export_trace``).

A recording is checked against ``recorded_expectations.EXPECTED`` (and the log's
invariants) before it is written, so a run where the fault missed its mark is never
checked in. Run it again when the log's vocabulary changes on purpose; the replay
test (tests/statemachine/test_recorded_traces.py) then tells whether today's policy
still makes the recorded decisions.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import io
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy.ext.asyncio import create_async_engine

from app.config import ReplicaConfig, Timeouts
from app.incident.trace_io import export_trace
from app.store import migrate
from app.store.embedded import EmbeddedPostgres
from statemachine.invariants import violations
from statemachine.replay import replay
from tests.support.choices import stream_choices
from tests.support.gateway import MODEL, RunningGateway, running_gateway
from tests.support.scripted_upstream import ScriptedUpstream, running_scripted_upstream
from tests.support.tcp_proxy import TcpProxy, tcp_proxy
from tests.support.transcript import stream_chat
from tests.support.workers import WorkerProcess, running_worker
from tests.traces.recorded_expectations import EXPECTED

RECORDED = Path(__file__).resolve().parent / "recorded"
SOURCE = "tests/traces/record.py"
TIMEOUTS = Timeouts(stall_s=1.0, lease_ttl_s=1.5, cancel_ack_s=0.5, first_token_soft_s=10.0, first_token_hard_s=20.0)
SIM_ARGS = ["--model", MODEL, "--heartbeat-ms", "100"]
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]


@dataclass
class Scene:
    """One scenario's world: the gateway, and the two workers behind their proxies."""

    gateway: RunningGateway
    workers: list[WorkerProcess]
    proxies: list[TcpProxy]
    upstreams: list[ScriptedUpstream] = field(default_factory=list)  # openai replicas, instead of workers

    def fault_first_attempt(self, prompt: str, **spec: Any) -> None:
        """Script ``spec`` on every worker, for attempt 1 of the request with ``prompt``."""
        for worker in self.workers:
            response = httpx.post(
                worker.base_url + "/admin/faults", json={**spec, "match": {"prompt_contains": prompt, "attempt": 1}}
            )
            response.raise_for_status()

    def worker_holding_an_attempt(self, timeout: float = 10.0) -> int:
        """The index of the first worker seen holding an attempt (each scene serves one request)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for index, worker in enumerate(self.workers):
                if httpx.get(worker.base_url + "/admin/attempts", timeout=5).json()["attempts"]:
                    return index
            time.sleep(0.01)
        raise AssertionError("no worker received the attempt")


def body(prompt: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 10, "seed": 7, **extra}


# --- the scenarios: each runs one request and returns its id --------------------------------


def retry_before_first_delta(scene: Scene) -> str:
    prompt = "recorded: retry before the first delta"
    scene.fault_first_attempt(prompt, action="die", point="before_frame", at_token=0)
    transcript = stream_chat(scene.gateway.url, body(prompt))
    assert transcript.done and transcript.error is None
    return transcript.request_id


def whole_answer_retried(scene: Scene) -> str:
    prompt = "recorded: a whole answer retried"
    scene.fault_first_attempt(prompt, action="die", point="after_frame", at_token=3)
    with scene.gateway.http() as http:
        response = http.post("/v1/chat/completions", json=body(prompt))
    assert response.status_code == 200, response.text
    return response.headers["x-request-id"]


def decode_interrupted(scene: Scene) -> str:
    prompt = "recorded: decode interrupted"
    scene.fault_first_attempt(prompt, action="die", point="after_frame", at_token=2)
    transcript = stream_chat(scene.gateway.url, body(prompt))
    assert transcript.error is not None and transcript.error["delivered_output_tokens"] == len(transcript.contents)
    return transcript.request_id


def choices_interrupted(scene: Scene) -> str:
    prompt = "recorded: two choices interrupted"
    scene.fault_first_attempt(prompt, action="die", point="after_frame", at_token=3)
    received = stream_choices(scene.gateway.url, body(prompt, n=2))
    error = received.transcript.error
    assert error is not None and error["delivered_output_tokens"] == len(received.transcript.contents)
    return received.transcript.request_id


def fence_released_by_lease_expiry(scene: Scene) -> str:
    """The network to the worker holding attempt 1 is cut while it is still in prefill."""
    prompt = "recorded: fence released by lease expiry"
    scene.fault_first_attempt(prompt, action="slow_prefill", prefill_ms=4000)

    def cut() -> None:
        scene.proxies[scene.worker_holding_an_attempt()].blackhole()

    cutter = threading.Thread(target=cut, daemon=True)
    cutter.start()
    transcript = stream_chat(scene.gateway.url, body(prompt))
    cutter.join(10)
    assert transcript.done and transcript.error is None
    return transcript.request_id


def fence_released_by_connection_close(scene: Scene) -> str:
    """The ``openai`` replica holding attempt 1 sends its first token only after 20 s."""
    for upstream in scene.upstreams:
        upstream.script({"delay_first_s": 20, "attempt": 1})
    transcript = stream_chat(scene.gateway.url, body("recorded: a first token after 20 s"))
    assert transcript.done and transcript.error is None
    return transcript.request_id


def client_disconnect(scene: Scene) -> str:
    prompt = "recorded: the client leaves"
    transcript = stream_chat(scene.gateway.url, body(prompt, max_tokens=400), on_delta=lambda n: n >= 3)
    return transcript.request_id


def client_resumed_within_grace(scene: Scene) -> str:
    prompt = "recorded: the client leaves and comes back"
    first = stream_chat(scene.gateway.url, body(prompt, max_tokens=60), on_delta=lambda n: n >= 3)
    time.sleep(0.2)  # deltas are produced with no client attached
    headers = {"last-event-id": str(first.event_ids[-1])}
    with (
        httpx.Client(base_url=scene.gateway.url, timeout=60) as http,
        http.stream("GET", f"/v1/requests/{first.request_id}/stream", headers=headers) as response,
    ):
        assert response.status_code == 200
        assert any(line == "data: [DONE]" for line in response.iter_lines())
    return first.request_id


def resume_grace_expired(scene: Scene) -> str:
    prompt = "recorded: the client leaves for good"
    transcript = stream_chat(scene.gateway.url, body(prompt, max_tokens=400), on_delta=lambda n: n >= 3)
    return transcript.request_id


def tool_call_replayed(scene: Scene) -> str:
    prompt = "recorded: a tool call, then death"
    scene.fault_first_attempt(prompt, action="tool_call_then_die", at_token=0, tool_name="lookup")
    transcript = stream_chat(scene.gateway.url, body(prompt, tools=TOOLS))
    assert transcript.done and len(transcript.tool_calls) == 1
    return transcript.request_id


SCENARIOS: dict[str, Callable[[Scene], str]] = {
    "retry_before_first_delta": retry_before_first_delta,
    "whole_answer_retried": whole_answer_retried,
    "decode_interrupted": decode_interrupted,
    "choices_interrupted": choices_interrupted,
    "fence_released_by_lease_expiry": fence_released_by_lease_expiry,
    "fence_released_by_connection_close": fence_released_by_connection_close,
    "client_disconnect": client_disconnect,
    "client_resumed_within_grace": client_resumed_within_grace,
    "resume_grace_expired": resume_grace_expired,
    "tool_call_replayed": tool_call_replayed,
}
# slow enough that the client leaves mid-answer
DECODE_MS = {"client_disconnect": 20.0, "client_resumed_within_grace": 20.0, "resume_grace_expired": 20.0}
# how long a client that left may come back (docs/design.md §12); 0: cancelled at once
RESUME_GRACE_S = {"client_resumed_within_grace": 10.0, "resume_grace_expired": 0.5}
# served by two scripted OpenAI-compatible upstreams (kind openai), with a short first-token deadline
OPENAI_SCENARIOS = {"fence_released_by_connection_close"}
OPENAI_TIMEOUTS = dataclasses.replace(TIMEOUTS, openai_first_token_s=1.0)
assert set(SCENARIOS) == set(EXPECTED)


@contextlib.contextmanager
def scene_for(name: str, database_url: str) -> Iterator[Scene]:
    """Two fresh workers behind proxies, a tool webhook and a gateway over them."""
    if name in OPENAI_SCENARIOS:
        with openai_scene(database_url) as scene:
            yield scene
        return
    decode_ms = DECODE_MS.get(name, 3.0)
    with ExitStack() as stack:
        workers = [
            stack.enter_context(
                running_worker(
                    faults=True,
                    args=[*SIM_ARGS, "--worker-id", f"r{n}", "--sim-decode-ms-per-token", str(decode_ms)],
                )
            )
            for n in (1, 2)
        ]
        proxies = [stack.enter_context(tcp_proxy(worker.base_url)) for worker in workers]
        for proxy in proxies:  # a cut link is mended before its proxy closes, so nothing hangs in it
            stack.callback(proxy.restore)
        hook = stack.enter_context(running_scripted_upstream())
        replicas = [ReplicaConfig(id=f"r{n}", url=proxy.url) for n, proxy in enumerate(proxies, start=1)]
        gateway = stack.enter_context(
            running_gateway(
                database_url,
                replicas,
                timeouts=TIMEOUTS,
                health_interval_s=30,
                tool_webhook_url=hook.base_url + "/tools/execute",
                resume_grace_s=RESUME_GRACE_S.get(name, 0.0),
            )
        )
        yield Scene(gateway, workers, proxies)


@contextlib.contextmanager
def openai_scene(database_url: str) -> Iterator[Scene]:
    """Two fresh scripted OpenAI-compatible upstreams and a gateway over them."""
    with ExitStack() as stack:
        upstreams = [stack.enter_context(running_scripted_upstream()) for _ in (1, 2)]
        replicas = [ReplicaConfig(id=f"u{n}", url=u.base_url, kind="openai") for n, u in enumerate(upstreams, start=1)]
        gateway = stack.enter_context(
            running_gateway(database_url, replicas, timeouts=OPENAI_TIMEOUTS, health_interval_s=30, resume_grace_s=0.0)
        )
        yield Scene(gateway, [], [], upstreams)


def record(name: str, database_url: str) -> str:
    """Run scenario ``name`` and return its trace, checked (AssertionError when it went astray)."""
    with scene_for(name, database_url) as scene:
        request_id = SCENARIOS[name](scene)
        events = scene.gateway.events(request_id)
    assert violations(events) == [], violations(events)
    result = replay(events)
    assert result.ok, result.divergence and result.divergence.describe()
    EXPECTED[name](events)
    return asyncio.run(_export(database_url, request_id, {"source": SOURCE, "scenario": name}))


async def _export(database_url: str, request_id: str, meta: dict[str, Any]) -> str:
    out = io.StringIO()
    engine = create_async_engine(database_url)
    try:
        async with engine.connect() as connection:
            await export_trace(connection, [request_id], out, meta=meta)
    finally:
        await engine.dispose()
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scenarios", nargs="*", metavar="SCENARIO", help=f"default: all of {', '.join(SCENARIOS)}")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.scenarios) - set(SCENARIOS))
    if unknown:
        parser.error(f"unknown scenarios: {', '.join(unknown)}")
    data_dir = tempfile.mkdtemp(prefix="phasegate-record-pg-")
    os.chmod(data_dir, 0o755)  # the server's user must be able to enter it (as in tests/conftest.py)
    server = EmbeddedPostgres(data_dir, settings={"fsync": "off"})
    server.start()
    try:
        migrate.upgrade(server.url)
        RECORDED.mkdir(exist_ok=True)
        for name in args.scenarios or SCENARIOS:
            path = RECORDED / f"{name}.jsonl"
            path.write_text(record(name, server.url))
            print(f"recorded {path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path}")
    finally:
        server.stop()
        shutil.rmtree(data_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
