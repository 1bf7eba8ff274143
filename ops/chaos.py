"""Chaos: many concurrent streams while workers are killed and restarted at random,
then an invariant check over the log and the clients' transcripts.

    python ops/chaos.py                                  # 500 streams, 60 s, 3 sim workers
    python ops/chaos.py --streams 50 --seconds 15 --seed 7

Real processes: sim workers and a gateway (``phasegate serve``) on an embedded
PostgreSQL (or ``DATABASE_URL``). Clients stream chat completions back to back and
keep what they received. Every ``--kill-every`` seconds (jittered) a random worker
is SIGKILLed and started again on its port a moment later. When the clients stop,
the gateway drains and the checker prints one table:

    requests      every request a client sent and got an id for
    completed     ended with [DONE]; the log says completed
    retried       needed more than one attempt (before any output)
    interrupted   ended with upstream_decode_interrupted after partial output
    other         refused or failed before output (no replica, retries spent)
    no response   the connection failed before any answer (no request id; the
                  openai client retries these); each is checked against the log below
    violations    requests breaking a rule of statemachine.invariants   (must be 0)
    events lost   what a client received that the log does not show, or output the log
                  delivered to a request no client got an answer for       (must be 0)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg
import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from app.store.database import asyncpg_dsn  # noqa: E402
from app.store.embedded import EmbeddedPostgres  # noqa: E402
from app.store.migrate import upgrade  # noqa: E402
from app.store.postgres import PostgresEventStore  # noqa: E402
from ops.processes import free_port, phasegate, start, stop, wait_http  # noqa: E402
from ops.transcript import Transcript  # noqa: E402
from statemachine import events as ev  # noqa: E402
from statemachine.invariants import violations  # noqa: E402
from statemachine.request_state import Outcome  # noqa: E402
from statemachine.state import fold  # noqa: E402

MODEL = "sim"


@dataclass
class Report:
    requests: int = 0
    completed: int = 0
    retried: int = 0
    interrupted: int = 0
    other: int = 0
    no_response: int = 0
    violations: int = 0
    events_lost: int = 0
    kills: int = 0
    problems: list[str] = field(default_factory=list)

    def table(self) -> str:
        rows = [
            ("requests", self.requests),
            ("completed", self.completed),
            ("retried", self.retried),
            ("interrupted", self.interrupted),
            ("other", self.other),
            ("no response", self.no_response),
            ("violations", self.violations),
            ("events lost", self.events_lost),
            ("worker kills", self.kills),
        ]
        return "\n".join(f"{name:>14} {value:>8}" for name, value in rows)


# --- the fleet -------------------------------------------------------------------------------


class Fleet:
    """Sim workers on fixed ports, killed and restarted at random by a thread."""

    def __init__(self, count: int, decode_ms: float, rng: random.Random) -> None:
        self.ports = [free_port() for _ in range(count)]
        self.decode_ms = decode_ms
        self.rng = rng
        self.processes: list[subprocess.Popen[bytes]] = [self._start(port) for port in self.ports]
        self.kills = 0
        self._stop = threading.Event()

    def _start(self, port: int) -> subprocess.Popen[bytes]:
        return start(
            phasegate(
                "worker",
                "--port",
                str(port),
                "--engine",
                "sim",
                "--model",
                MODEL,
                "--sim-decode-ms-per-token",
                str(self.decode_ms),
                "--max-running",
                "2000",
                "--max-queued",
                "2000",
            )
        )

    def wait_ready(self) -> None:
        for port in self.ports:
            wait_http(f"http://127.0.0.1:{port}/v1/ready")

    def chaos(self, kill_every_s: float, down_s: float) -> threading.Thread:
        def loop() -> None:
            while not self._stop.wait(kill_every_s * self.rng.uniform(0.5, 1.5)):
                index = self.rng.randrange(len(self.ports))
                stop(self.processes[index], signal.SIGKILL)
                self.kills += 1
                if self._stop.wait(down_s):
                    break
                self.processes[index] = self._start(self.ports[index])

        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        return thread

    def calm(self, thread: threading.Thread) -> None:
        self._stop.set()
        thread.join()
        for index, process in enumerate(self.processes):
            if process.poll() is not None:
                self.processes[index] = self._start(self.ports[index])

    def close(self) -> None:
        for process in self.processes:
            stop(process)


# --- the clients -----------------------------------------------------------------------------


async def clients(gateway_url: str, streams: int, seconds: float, rng: random.Random) -> list[Transcript]:
    transcripts: list[Transcript] = []
    deadline = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=streams)
    async with httpx.AsyncClient(base_url=gateway_url, timeout=120.0, limits=limits) as http:

        async def client(n: int) -> None:
            await asyncio.sleep(rng.uniform(0, 1.0))
            while time.monotonic() < deadline:
                body = {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": f"chaos {n} {rng.random()}"}],
                    "stream": True,
                    "max_tokens": rng.randint(5, 60),
                }
                transcripts.append(await one(http, body))

        await asyncio.gather(*(client(n) for n in range(streams)))
    return transcripts


async def one(http: httpx.AsyncClient, body: dict[str, object]) -> Transcript:
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            transcript = Transcript(response.headers.get("x-request-id", ""), response.status_code)
            if response.status_code != 200:
                transcript.error = json.loads(await response.aread()).get("error")
                return transcript
            async for line in response.aiter_lines():
                transcript.read(line)
            return transcript
    except httpx.HTTPError as exc:  # the gateway itself never goes away here: record it
        return Transcript("", 0, error={"code": "client_error", "message": repr(exc)})


# --- the checker -----------------------------------------------------------------------------


async def check(database_url: str, gateway_id: str, transcripts: list[Transcript]) -> Report:
    report = Report()
    store = await PostgresEventStore.connect(database_url)
    try:
        if unfinished := await store.unfinished_requests():
            report.problems.append(f"{len(unfinished)} request(s) never ended: {unfinished[:5]}")
            report.violations += len(unfinished)
        for transcript in transcripts:
            if not transcript.request_id:
                report.no_response += 1  # checked below, against what the log accepted
                continue
            report.requests += 1
            events = await store.read(transcript.request_id)
            if transcript.status != 200 and not events:
                report.other += 1  # refused before acceptance
                continue
            broken = violations(events)
            if broken:
                report.violations += 1
                report.problems.append(f"{transcript.request_id}: {'; '.join(broken)}")
                continue
            state = fold(events)
            delivered = "".join(e.text or "" for e in events if isinstance(e, ev.DeltasDelivered) and e.tokens)
            client_completed = transcript.done and transcript.error is None  # an error event also ends in [DONE]
            if "".join(transcript.contents) != delivered or client_completed != (state.outcome is Outcome.COMPLETED):
                report.events_lost += 1
                got = "".join(transcript.contents)
                report.problems.append(
                    f"{transcript.request_id}: the client got {got!r} (completed: {client_completed}),"
                    f" the log says {delivered!r} ({state.outcome})"
                )
            report.retried += len(state.attempts) > 1
            if state.outcome is Outcome.COMPLETED:
                report.completed += 1
            elif state.error_code == "upstream_decode_interrupted":
                report.interrupted += 1
            else:
                report.other += 1
        # A request the gateway accepted that no client got an answer for (its connection
        # failed first) must not have delivered anything: that output would be lost.
        seen = {transcript.request_id for transcript in transcripts}
        unseen = [rid for rid in await accepted_by(database_url, gateway_id) if rid not in seen]
        for request_id in unseen:
            if any(isinstance(e, ev.DeltasDelivered) and e.tokens for e in await store.read(request_id)):
                report.events_lost += 1
                report.problems.append(f"{request_id}: output delivered, but no client got an answer")
        if len(unseen) > report.no_response:
            report.problems.append(f"{len(unseen)} accepted requests went unanswered, {report.no_response} clients saw")
    finally:
        await store.close()
    return report


async def accepted_by(database_url: str, gateway_id: str) -> list[str]:
    connection = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        rows = await connection.fetch("SELECT request_id FROM requests WHERE gateway = $1", gateway_id)
        return [row["request_id"] for row in rows]
    finally:
        await connection.close()


# --- the run ---------------------------------------------------------------------------------


def run_chaos(
    database_url: str,
    *,
    streams: int = 500,
    seconds: float = 60.0,
    workers: int = 3,
    kill_every_s: float = 3.0,
    down_s: float = 1.0,
    decode_ms: float = 20.0,
    seed: int = 1,
) -> Report:
    rng = random.Random(seed)
    fleet = Fleet(workers, decode_ms, rng)
    gateway_port = free_port()
    command = phasegate("serve", "--port", str(gateway_port), "--log-level", "warning", "--model", f"{MODEL}=chaos")
    for number, port in enumerate(fleet.ports, start=1):
        command += ["--replica", f"worker=http://127.0.0.1:{port}#w{number}"]
    gateway = None
    try:
        fleet.wait_ready()
        gateway = start(command, {"DATABASE_URL": database_url})
        gateway_url = f"http://127.0.0.1:{gateway_port}"
        wait_http(gateway_url + "/readyz")
        thread = fleet.chaos(kill_every_s, down_s)
        transcripts = asyncio.run(clients(gateway_url, streams, seconds, rng))
        fleet.calm(thread)
        stop(gateway, signal.SIGTERM, grace_s=30.0)  # graceful: it drains its bookkeeping first
        gateway = None
        report = asyncio.run(check(database_url, f"{socket.gethostname()}:{gateway_port}", transcripts))
        report.kills = fleet.kills
        return report
    finally:
        if gateway is not None:
            stop(gateway)
        fleet.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=500)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--kill-every", type=float, default=3.0, help="seconds between worker kills (jittered)")
    parser.add_argument("--decode-ms", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=1)
    options = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="phasegate-chaos-"))
    workdir.chmod(0o755)  # the embedded server's own user must enter it
    database = EmbeddedPostgres(workdir / "pg")
    try:
        url = database.start()
        upgrade(url)
        began = time.monotonic()
        report = run_chaos(
            url,
            streams=options.streams,
            seconds=options.seconds,
            workers=options.workers,
            kill_every_s=options.kill_every,
            decode_ms=options.decode_ms,
            seed=options.seed,
        )
        print(report.table())
        print(f"{'took':>14} {time.monotonic() - began:>7.0f}s")
        for problem in report.problems[:20]:
            print("  ", problem)
        sys.exit(1 if report.violations or report.events_lost else 0)
    finally:
        database.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
