"""Health probes through a real gateway over a real sim worker: a replica too busy to
answer a probe in time but streaming to live attempts is not ejected; a stopped worker,
still is.

The probe's deadline is cut to half a second on the gateway's real worker client (its
default is 10 s), and the busy worker's probe, a real generation with no cache, takes
longer than that: its prefill is slow, as on an engine saturated by the streams it serves.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import pytest

from app.config import ReplicaConfig
from app.replicas.replica import Replica
from app.replicas.worker import WorkerReplica
from tests.support.gateway import MODEL, RunningGateway, running_gateway
from tests.support.workers import WorkerProcess, running_worker

PROBE_TIMEOUT_S = 0.5
BUSY = ["--sim-prefill-ms-per-token", "300", "--sim-decode-ms-per-token", "40", "--health-ttl-s", "0"]


@contextlib.contextmanager
def gateway_over(database_url: str, worker: WorkerProcess, **overrides: Any) -> Iterator[RunningGateway]:
    """A gateway probing ``worker`` every 0.1 s (three failures in a row eject, unless overridden)."""
    configs = [ReplicaConfig(id="a", url=worker.base_url)]
    with running_gateway(database_url, configs, health_interval_s=0.1, **overrides) as gateway:
        assert wait_for(lambda: replica(gateway).healthy is True, 10)  # on the default deadline
        yield gateway


def shorten_the_probes(gateway: RunningGateway) -> None:
    cast(WorkerReplica, replica(gateway).client).client.control_timeout = PROBE_TIMEOUT_S


def replica(gateway: RunningGateway) -> Replica:
    return gateway.gateway.ctx.pool.replicas["a"]


def wait_for(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def not_counted(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "not counted" in r.getMessage()]


def stream(gateway: RunningGateway, prompt: str, max_tokens: int) -> str:
    chunks = gateway.openai().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, stream=True
    )
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def timed_stream(gateway: RunningGateway, prompt: str, max_tokens: int) -> float:
    """``stream``, then when it ended (the clock of log records)."""
    assert stream(gateway, prompt, max_tokens)
    return time.time()


def test_a_replica_too_busy_for_its_probes_but_streaming_is_not_ejected(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="phasegate.pool")
    busy = running_worker(args=["--model", MODEL, *BUSY])
    # one counted probe would eject it
    with busy as worker, gateway_over(database_url, worker, eject_after_failures=1) as gateway:
        a = replica(gateway)
        with ThreadPoolExecutor(2) as clients:
            # seconds of frames, outlasting the second's: a replica whose only attempt is in its
            # prefill reads no frames, and a loaded machine ended an 80-token first there
            first = clients.submit(timed_stream, gateway, "busy", 200)
            assert wait_for(lambda: a.frames_read > 0, 10)
            shorten_the_probes(gateway)  # from now on every probe times out
            assert wait_for(lambda: len(not_counted(caplog)) >= 2, 10)
            second = clients.submit(timed_stream, gateway, "while its probes time out", 8)
            streamed_until = max(first.result(60), second.result(60))  # both served by the only replica: no 503
            excused = not_counted(caplog)
            assert len(excused) >= 3, excused  # without the frames, the first of them ejected it
            # never ejected while it streamed; once it is idle, a probe that times out counts
            # again and may eject it by now, as the next test wants
            ejected = [r.getMessage() for r in caplog.records if "ejected" in r.getMessage()]
            assert all(r.created > streamed_until for r in caplog.records if "ejected" in r.getMessage()), ejected


def test_a_stopped_worker_is_still_ejected_by_its_probes(database_url: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="phasegate.pool")
    with running_worker(args=["--model", MODEL]) as worker, gateway_over(database_url, worker) as gateway:
        a = replica(gateway)
        shorten_the_probes(gateway)
        os.killpg(worker.pid, signal.SIGSTOP)  # alive, listening, silent
        try:
            # three probes of 0.5 s; a probe already in flight when the deadline was cut keeps
            # its 10 s one, so the bound is generous: only a worker never ejected reaches it
            assert wait_for(lambda: a.healthy is False, 30), "a stopped worker was never ejected"
            assert not gateway.gateway.ctx.pool.available(a)
            assert not not_counted(caplog)
        finally:
            os.killpg(worker.pid, signal.SIGCONT)
        assert wait_for(lambda: a.healthy is True, 10)  # probed back in
