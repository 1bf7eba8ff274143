"""Chaos: many concurrent streams while workers (and gateways) are killed and
restarted at random, then an invariant check over the log and the clients' transcripts.

    python ops/chaos.py                                  # 500 streams, 60 s, 3 sim workers
    python ops/chaos.py --streams 50 --seconds 15 --seed 7
    python ops/chaos.py --gateways 3 --kill-gateway-every 5

Real processes: sim workers and gateways (``phasegate serve``) on one embedded
PostgreSQL (or ``DATABASE_URL``). Clients, spread over the gateways, stream chat
completions back to back and keep what they received. Every ``--kill-every``
seconds (jittered) a random worker is SIGKILLed and started again on its port a
moment later; with ``--kill-gateway-every``, a random gateway too, started again as
a new instance while the others sweep the one that died. When the clients stop,
every request must be terminal, the gateways drain, and the checker
(``ops/chaos_check.py``) prints one table of what the clients and the log say.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from app.store.embedded import EmbeddedPostgres  # noqa: E402
from app.store.migrate import upgrade  # noqa: E402
from ops.chaos_check import Report, check, until_all_ended  # noqa: E402
from ops.processes import free_port, phasegate, start, stop, wait_http  # noqa: E402
from ops.transcript import Transcript  # noqa: E402

MODEL = "sim"


# --- the fleet -------------------------------------------------------------------------------


class Fleet:
    """Processes on fixed ports (sim workers, or gateways), killed and restarted at random
    by a thread: a restarted gateway is a new instance on the same port."""

    def __init__(
        self, commands: list[list[str]], ready_urls: list[str], rng: random.Random, env: dict[str, str] | None = None
    ) -> None:
        self.commands = commands
        self.ready_urls = ready_urls
        self.rng = rng
        self.env = env
        self.processes: list[subprocess.Popen[bytes]] = [start(command, env) for command in commands]
        self.kills = 0
        self._stop = threading.Event()

    @classmethod
    def workers(cls, count: int, decode_ms: float, rng: random.Random) -> Fleet:
        ports = [free_port() for _ in range(count)]
        sim = ["--engine", "sim", "--model", MODEL, "--sim-decode-ms-per-token", str(decode_ms)]
        sim += ["--max-running", "2000", "--max-queued", "2000"]
        commands = [phasegate("worker", "--port", str(port), *sim) for port in ports]
        return cls(commands, [f"http://127.0.0.1:{port}/v1/ready" for port in ports], rng)

    @classmethod
    def gateways(cls, count: int, workers: Fleet, settings: Path, database_url: str, rng: random.Random) -> Fleet:
        ports = [free_port() for _ in range(count)]
        replicas = [
            arg
            for number, url in enumerate(workers.ready_urls, start=1)
            for arg in ("--replica", f"worker={url.removesuffix('/v1/ready')}#w{number}")
        ]
        serve = ["--log-level", "warning", "--model", f"{MODEL}=chaos", "--config", str(settings), *replicas]
        commands = [phasegate("serve", "--processes", "1", "--port", str(port), *serve) for port in ports]
        urls = [f"http://127.0.0.1:{port}/readyz" for port in ports]
        return cls(commands, urls, rng, {"DATABASE_URL": database_url})

    @property
    def base_urls(self) -> list[str]:
        return [url.rsplit("/", 1)[0] if url.endswith("/readyz") else url for url in self.ready_urls]

    def wait_ready(self) -> None:
        for url in self.ready_urls:
            wait_http(url)

    def chaos(self, kill_every_s: float, down_s: float) -> threading.Thread:
        def loop() -> None:
            while not self._stop.wait(kill_every_s * self.rng.uniform(0.5, 1.5)):
                index = self.rng.randrange(len(self.commands))
                stop(self.processes[index], signal.SIGKILL)
                self.kills += 1
                if self._stop.wait(down_s):
                    break
                self.processes[index] = start(self.commands[index], self.env)

        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        return thread

    def calm(self, thread: threading.Thread | None) -> None:
        """Stop killing; start again whatever is down, and wait until all answer."""
        self._stop.set()
        if thread is not None:
            thread.join()
        for index, process in enumerate(self.processes):
            if process.poll() is not None:
                self.processes[index] = start(self.commands[index], self.env)
        self.wait_ready()

    def close(self, sig: int = signal.SIGTERM, grace_s: float = 10.0) -> None:
        for process in self.processes:
            stop(process, sig, grace_s)


# --- the clients -----------------------------------------------------------------------------


async def clients(gateway_urls: list[str], streams: int, seconds: float, rng: random.Random) -> list[Transcript]:
    """``streams`` clients, spread over the gateways, each streaming back to back."""
    transcripts: list[Transcript] = []
    deadline = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=streams)
    async with httpx.AsyncClient(timeout=120.0, limits=limits) as http:

        async def client(n: int) -> None:
            url = gateway_urls[n % len(gateway_urls)] + "/v1/chat/completions"
            await asyncio.sleep(rng.uniform(0, 1.0))
            while time.monotonic() < deadline:
                body = {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": f"chaos {n} {rng.random()}"}],
                    "stream": True,
                    "max_tokens": rng.randint(5, 60),
                }
                transcript = await one(http, url, body)
                transcripts.append(transcript)
                if transcript.status == 0:
                    await asyncio.sleep(0.2)  # its gateway is down: give the restart a moment

        await asyncio.gather(*(client(n) for n in range(streams)))
    return transcripts


async def one(http: httpx.AsyncClient, url: str, body: dict[str, object]) -> Transcript:
    transcript = Transcript("", 0)
    try:
        async with http.stream("POST", url, json=body) as response:
            transcript.request_id = response.headers.get("x-request-id", "")
            transcript.status = response.status_code
            if response.status_code != 200:
                transcript.error = json.loads(await response.aread()).get("error")
                return transcript
            async for line in response.aiter_lines():
                transcript.read(line)
            return transcript
    except httpx.HTTPError as exc:
        if not transcript.request_id:  # no answer at all: checked against the log by the checker
            return Transcript("", 0, error={"code": "client_error", "message": repr(exc)})
        transcript.cut = True  # mid-stream: its gateway died under it
        return transcript


# --- the run ---------------------------------------------------------------------------------


GATEWAY_SETTINGS = """
instance_lease_ttl_s = 2.0
sweep_interval_s = 0.5
delivery_batch_tokens = 16
"""
BATCH_DELTAS = 16


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
    gateways: int = 1,
    kill_gateway_every_s: float | None = None,
) -> Report:
    rng = random.Random(seed)
    workdir = Path(tempfile.mkdtemp(prefix="phasegate-chaos-gateways-"))
    settings = workdir / "phasegate.toml"
    settings.write_text(GATEWAY_SETTINGS)
    fleet = Fleet.workers(workers, decode_ms, rng)
    front: Fleet | None = None
    try:
        fleet.wait_ready()
        front = Fleet.gateways(gateways, fleet, settings, database_url, rng)
        front.wait_ready()
        thread = fleet.chaos(kill_every_s, down_s)
        gateway_thread = front.chaos(kill_gateway_every_s, down_s) if kill_gateway_every_s else None
        transcripts = asyncio.run(clients(front.base_urls, streams, seconds, rng))
        fleet.calm(thread)
        front.calm(gateway_thread)
        # the last gateway killed is swept by a live one within its lease and a sweep
        asyncio.run(until_all_ended(database_url, timeout_s=30.0))
        front.close(signal.SIGTERM, grace_s=30.0)  # graceful: each drains its bookkeeping first
        gateway_kills, front = front.kills, None
        report = asyncio.run(check(database_url, transcripts, BATCH_DELTAS))
        report.kills, report.gateway_kills = fleet.kills, gateway_kills
        return report
    finally:
        if front is not None:
            front.close(signal.SIGKILL)
        fleet.close()
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=500)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--kill-every", type=float, default=3.0, help="seconds between worker kills (jittered)")
    parser.add_argument("--decode-ms", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--gateways", type=int, default=1, help="gateway instances sharing the log")
    parser.add_argument(
        "--kill-gateway-every", type=float, default=None, help="seconds between gateway SIGKILLs (jittered)"
    )
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
            gateways=options.gateways,
            kill_gateway_every_s=options.kill_gateway_every,
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
