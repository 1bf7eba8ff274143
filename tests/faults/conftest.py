"""Fault-injection fixtures: two replicas of either kind behind proxies, revived after deaths.

- ``fleet`` (module, parametrized ``worker`` | ``openai``): two replicas, ``r1`` and
  ``r2``, each reached through a :class:`TcpProxy` so a test can cut the network.
  ``worker``: sim workers (faults enabled, 200 ms/token when asked for, else 5 ms);
  ``openai``: scripted OpenAI-compatible upstreams. A replica a test killed is started
  again before the next test (on a new port, behind the same proxy).
- ``fleet.fault_first_attempt(fault)``: the generic faults of the suite, translated to
  each kind's scripting: ``die`` (point, k), ``tool_call_then_die`` (k), ``slow_first``.
- ``database_url`` (function): the root fixture's fresh database, audited after the
  test: the read models the real gateway's writes projected must agree with the fold
  of the events it wrote (``app.store.audit.fold_disagreements``), on every log a
  fault test leaves behind, not only on hand-built ones.
- ``evidence``: keeps the trace, inputs and transcript of every request a test
  checks, and writes them to ``artifacts/faults/<test>/`` when the test fails, so a
  rare failure can be replayed (``phasegate replay trace.jsonl``).
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.config import ReplicaConfig, Timeouts
from statemachine.events import Event
from statemachine.trace import dump_trace
from tests.faults.token_loop import TIMEOUTS
from tests.support.audit import fold_disagreements_in
from tests.support.gateway import MODEL, RunningGateway, running_gateway
from tests.support.scripted_upstream import ScriptedUpstream, running_scripted_upstream
from tests.support.tcp_proxy import TcpProxy, tcp_proxy
from tests.support.transcript import Transcript
from tests.support.workers import WorkerProcess, start_worker

ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts" / "faults"
KINDS = ["worker", "openai"]


@dataclass
class Replica:
    id: str
    proxy: TcpProxy
    stack: ExitStack
    process: WorkerProcess | ScriptedUpstream

    @property
    def direct_url(self) -> str:
        return self.process.base_url

    @property
    def alive(self) -> bool:
        process = self.process
        return process.alive() if isinstance(process, WorkerProcess) else process.alive


@dataclass
class Fleet:
    kind: str
    decode_ms: float
    replicas: list[Replica] = field(default_factory=list)

    @property
    def configs(self) -> list[ReplicaConfig]:
        return [ReplicaConfig(id=r.id, url=r.proxy.url, kind=self.kind) for r in self.replicas]

    def start(self, replica_id: str) -> Replica:
        stack = ExitStack()
        process: WorkerProcess | ScriptedUpstream
        if self.kind == "worker":
            args = ["--model", MODEL, "--worker-id", replica_id, "--heartbeat-ms", "100"]
            args += ["--sim-decode-ms-per-token", str(self.decode_ms)]
            process = start_worker(faults=True, args=args)
            stack.callback(process.kill)
        else:
            process = stack.enter_context(running_scripted_upstream(token_delay_s=self.decode_ms / 1000))
        proxy = stack.enter_context(tcp_proxy(process.base_url))
        return Replica(replica_id, proxy, stack, process)

    def revive(self) -> None:
        """Start again any replica a test killed (a new process behind its own proxy)."""
        for index, replica in enumerate(self.replicas):
            if not replica.alive:
                replica.stack.close()
                self.replicas[index] = self.start(replica.id)
            replica = self.replicas[index]
            replica.proxy.restore()
            if self.kind == "worker":
                httpx.delete(replica.direct_url + "/admin/faults")
            else:
                replica.process.script()  # type: ignore[union-attr]

    def busy_attempts(self, timeout: float = 30.0) -> list[dict[str, Any]]:
        """The attempts a worker fleet still runs (engine not over), and its engines' running
        requests, once ``timeout`` passed waiting for none: an earlier test's attempt that
        holds a worker's slots would queue this test's first attempt, and a queued attempt
        is retried elsewhere."""
        deadline = time.monotonic() + timeout
        while True:
            busy: list[dict[str, Any]] = []
            for replica in self.replicas if self.kind == "worker" else ():
                answer = httpx.get(replica.direct_url + "/admin/attempts", timeout=10).json()
                busy += [{"replica": replica.id, **a} for a in answer["attempts"] if not a["engine_over"]]
                busy += [{"replica": replica.id, "engine_request": r} for r in answer["engine_requests"]]
            if not busy or time.monotonic() >= deadline:
                return busy
            time.sleep(0.05)

    def fault_first_attempt(
        self, prompt: str, fault: str, *, k: int = 0, point: str = "before_frame", **extra: Any
    ) -> None:
        """Script ``fault`` for the first attempt of the request with ``prompt``, on every replica."""
        for replica in self.replicas:
            if self.kind == "worker":
                spec = _worker_fault(fault, k, point, extra)
                spec["match"] = {"prompt_contains": prompt, "attempt": 1}
                response = httpx.post(replica.direct_url + "/admin/faults", json=spec, timeout=5)
                response.raise_for_status()
            else:
                replica.process.script({**_upstream_fault(fault, k, point, extra), "attempt": 1})  # type: ignore[union-attr]

    def clear_faults(self) -> None:
        """Drop every scripted fault not met yet, on every replica still up (one armed for a
        first attempt on every replica waits on those the request never reached)."""
        for replica in self.replicas:
            with contextlib.suppress(httpx.HTTPError):
                if self.kind == "worker":
                    httpx.delete(replica.direct_url + "/admin/faults", timeout=5)
                else:
                    replica.process.script()  # type: ignore[union-attr]

    def close(self) -> None:
        for replica in self.replicas:
            replica.stack.close()


def _worker_fault(fault: str, k: int, point: str, extra: dict[str, Any]) -> dict[str, Any]:
    if fault == "die":
        return {"action": "die", "point": point, "at_token": k}
    if fault == "tool_call_then_die":
        return {"action": "tool_call_then_die", "at_token": k, "tool_name": extra.get("tool_name", "lookup")}
    if fault == "slow_first":
        return {"action": "slow_prefill", "prefill_ms": int(extra["seconds"] * 1000)}
    raise ValueError(fault)


def _upstream_fault(fault: str, k: int, point: str, extra: dict[str, Any]) -> dict[str, Any]:
    if fault == "die":
        return {"die_at": k, "point": point}
    if fault == "tool_call_then_die":
        return {"tool_call_then_die": True}
    if fault == "slow_first":
        return {"delay_first_s": extra["seconds"]}
    raise ValueError(fault)


@contextlib.contextmanager
def fleet_of(kind: str, decode_ms: float) -> Iterator[Fleet]:
    fleet = Fleet(kind, decode_ms)
    try:
        fleet.replicas = [fleet.start("r1"), fleet.start("r2")]
        yield fleet
    finally:
        fleet.close()


@pytest.fixture(scope="module", params=KINDS)
def fleet(request: pytest.FixtureRequest) -> Iterator[Fleet]:
    with fleet_of(request.param, decode_ms=5.0) as started:
        yield started


@pytest.fixture
def live_fleet(fleet: Fleet) -> Fleet:
    fleet.revive()
    return fleet


# --- the read models against the fold, on the logs the fault tests wrote -----------------------


@pytest.fixture
def database_url(database_url: str) -> Iterator[str]:
    """The root ``database_url``, checked once the test is done with it (every gateway it
    started is closed by then: they all depend on this fixture or live in the test body)."""
    yield database_url
    found = fold_disagreements_in(database_url)
    assert not found, "the read models disagree with the fold of the log:\n" + "\n".join(map(str, found))


# --- evidence for failures ------------------------------------------------------------------


@dataclass
class Evidence:
    kept: list[dict[str, Any]] = field(default_factory=list)

    def keep(self, request_id: str, events: list[Event], transcript: Transcript | None, inputs: Any = None) -> None:
        self.kept.append({"request_id": request_id, "events": events, "transcript": transcript, "inputs": inputs})

    def write(self, name: str) -> Path:
        folder = ARTIFACTS / re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
        folder.mkdir(parents=True, exist_ok=True)
        for item in self.kept:
            stem = folder / item["request_id"]
            stem.with_suffix(".jsonl").write_text("".join(dump_trace(item["events"], {"source": name})))
            extra = {"inputs": item["inputs"], "transcript": asdict(item["transcript"]) if item["transcript"] else None}
            stem.with_suffix(".json").write_text(json.dumps(extra, indent=2, default=str))
        return folder


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if report.when == "call":
        item.stash[_FAILED] = report.failed
    return report


_FAILED = pytest.StashKey[bool]()


@pytest.fixture
def evidence(request: pytest.FixtureRequest) -> Iterator[Evidence]:
    kept = Evidence()
    yield kept
    if request.node.stash.get(_FAILED, False) and kept.kept:
        folder = kept.write(request.node.nodeid)
        print(f"evidence kept in {folder}")


# --- the token-loop tests' gateways (tests/faults/token_loop.py) ------------------------------------


def _timeouts(request: pytest.FixtureRequest, kind: str | None = None) -> Timeouts:
    """The test module's own ``TIMEOUTS`` (``TIMEOUTS_BY_KIND[kind]`` where it names the
    fleet's replica kind), else the token-loop tests' generous ones."""
    timeouts: Timeouts = getattr(request.module, "TIMEOUTS", TIMEOUTS)
    by_kind: dict[str, Timeouts] = getattr(request.module, "TIMEOUTS_BY_KIND", {})
    return by_kind.get(kind, timeouts) if kind is not None else timeouts


@pytest.fixture
def loop_gateway(database_url: str, live_fleet: Fleet, request: pytest.FixtureRequest) -> Iterator[RunningGateway]:
    timeouts = _timeouts(request)
    with running_gateway(database_url, live_fleet.configs, timeouts=timeouts, health_interval_s=30) as running:
        yield running


# 4 and 7 need the network cut or the client gone at an exact token: slow tokens
@pytest.fixture(scope="module", params=KINDS)
def slow_fleet(request: pytest.FixtureRequest) -> Iterator[Fleet]:
    with fleet_of(request.param, decode_ms=150.0) as started:
        yield started


@pytest.fixture
def slow_gateway(database_url: str, slow_fleet: Fleet, request: pytest.FixtureRequest) -> Iterator[RunningGateway]:
    slow_fleet.revive()
    # test 7: a client that leaves is cancelled at once (tests/app/api/test_disconnect_grace.py: the grace)
    with running_gateway(
        database_url,
        slow_fleet.configs,
        timeouts=_timeouts(request, slow_fleet.kind),
        health_interval_s=30,
        resume_grace_s=0,
    ) as running:
        yield running
