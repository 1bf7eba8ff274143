"""The churn soak: mixed traffic through gateway instances on one PostgreSQL while the fleet
changes under them, then a verdict per request and on the gateways' memory.

    python ops/churn.py --seconds 600                    # ten minutes
    python ops/churn.py --seconds 120 --clients 16 --seed 3

Real processes: ``--gateways`` gateway instances (``phasegate serve --sim-workers 0``) on one
embedded PostgreSQL of its own (restarted during the run, so never a shared one), and sim
workers that join by themselves (``phasegate worker --engine sim --join``, docs/design.md §16).
Clients (ops/churn_traffic.py) send chat streamed and whole, tool calls, background Responses
polled to their end, and streams dropped and resumed with ``Last-Event-ID``. Meanwhile, every
``--churn-every`` seconds (jittered), one fleet change: a worker joins, leaves (``DELETE
/admin/replicas/{id}``, its attempts run to their end; then it is stopped), is drained
(``phasegate replicas remove --drain-s 1``: its attempts still live after a second are
fenced), is cordoned or uncordoned (the admin API), or is SIGKILLed (it lapses). Once, at a
third of the run, one gateway is stopped and started again; once, at two thirds, PostgreSQL is.
Every ``--sources-every`` seconds a DNS record is added or removed (dnsmasq) or the settings file
is reloaded with ``SIGHUP``, each change's propagation timed (ops/churn_sources.py).
Each gateway's RSS is read from /proc every second.

The verdict (ops/churn_check.py) and its table: requests by kind and outcome, fleet changes by
kind, the checks (spliced or duplicated answers, requests that never ended, clients that differ
from their log, RSS growth over 10 % from the first quarter to the last), RSS per quarter. Exit
status 1 when any check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from app.store.embedded import EmbeddedPostgres  # noqa: E402
from app.store.migrate import upgrade  # noqa: E402
from app.store.postgres import PostgresEventStore  # noqa: E402
from ops.chaos_check import until_all_ended  # noqa: E402
from ops.churn_check import Sample, Verdict, check, judge_rss  # noqa: E402
from ops.churn_gateways import Gateways  # noqa: E402
from ops.churn_sources import Dns, Sources, dnsmasq_binary  # noqa: E402
from ops.churn_traffic import MODEL, Record, clients  # noqa: E402
from ops.processes import free_port, phasegate, start, stop, wait_http  # noqa: E402
from statemachine.trace import dump_trace  # noqa: E402

ADMIN_TOKEN = "churn-admin-token-0123456789"
WORKER_TOKEN = "churn-worker-token-0123456789"
# The instances' lease is the default one, which outlasts PostgreSQL's restart: the log's
# outage is then the runbook's "Log outage" (each request cut by it is closed in the log as
# its client was told). Under a lease shorter than the outage, every instance lapses with
# it and a sweep closes their requests gateway_lost instead (docs/runbook.md: Gateway lost).
SETTINGS = f"""
admin_token = "{ADMIN_TOKEN}"
delivery_batch_tokens = 16
"""
BATCH_DELTAS = 16
ENV = {"PHASEGATE_WORKER_TOKEN": WORKER_TOKEN}


class Churn:
    """The fleet's changes, one every few seconds, from a thread: joins, leaves, cordons,
    uncordons, SIGKILLs; the workers it started, by id."""

    def __init__(self, gateways: Gateways, rng: random.Random, decode_ms: float, least: int, most: int) -> None:
        self.gateways, self.rng, self.decode_ms = gateways, rng, decode_ms
        self.least, self.most = least, most
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        self.cordoned: set[str] = set()
        self.changes: dict[str, int] = {}
        self.errors: list[str] = []
        self.stopped = threading.Event()
        self._number = 0
        self._lock = threading.Lock()

    def join(self) -> None:
        self._number += 1
        worker_id, port = f"c{self._number}", free_port()
        command = phasegate("worker", "--engine", "sim", "--model", MODEL, "--worker-id", worker_id)
        command += ["--port", str(port), "--sim-decode-ms-per-token", str(self.decode_ms), "--heartbeat-ms", "200"]
        command += ["--max-running", "500", "--max-queued", "500", "--join", self.rng.choice(self.gateways.urls)]
        self.workers[worker_id] = start(command, ENV)
        self._count("join")

    def _admin(self, method: str, path: str) -> bool:
        url = self.rng.choice(self.gateways.urls) + path
        try:
            answer = httpx.request(method, url, headers={"authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30)
        except httpx.HTTPError as exc:
            self.errors.append(f"{method} {path}: {exc!r}")
            return False
        if answer.status_code >= 300:
            self.errors.append(f"{method} {path}: {answer.status_code} {answer.text[:200]}")
        return answer.status_code < 300

    def _cli(self, *args: str) -> bool:
        """``phasegate replicas …`` against a random gateway, the token from the environment."""
        command = phasegate("replicas", "--gateway", self.rng.choice(self.gateways.urls), *args)
        env = {**os.environ, "PHASEGATE_ADMIN_TOKEN": ADMIN_TOKEN}
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=60, check=False)
        if done.returncode != 0:
            self.errors.append(f"phasegate replicas {' '.join(args)}: {done.returncode} {done.stderr[-200:]}")
        return done.returncode == 0

    def step(self) -> None:
        live = [w for w, p in self.workers.items() if p.poll() is None]
        serving = [w for w in live if w not in self.cordoned]
        choices = ["join"] * (len(live) < self.most) + ["uncordon"] * bool(self.cordoned)
        if len(serving) > self.least:
            choices += ["leave", "drain", "cordon", "kill"]
        fresh = [c for c in choices if c not in self.changes]  # each kind early, then at random
        action = self.rng.choice(fresh or choices or ["join"])
        if action == "join":
            self.join()
            return
        if action == "uncordon":
            worker_id = self.rng.choice(sorted(self.cordoned))
            if self._admin("POST", f"/admin/replicas/{worker_id}/uncordon"):
                self.cordoned.discard(worker_id)
                self._count("uncordon")
            return
        worker_id = self.rng.choice(serving)
        if action == "cordon" and self._admin("POST", f"/admin/replicas/{worker_id}/cordon"):
            self.cordoned.add(worker_id)
            self._count("cordon")
        elif (action == "leave" and self._admin("DELETE", f"/admin/replicas/{worker_id}")) or (
            action == "drain" and self._cli("remove", "--drain-s", "1", worker_id)
        ):
            # it leaves once its attempts end; stopped then (a live worker asked to renew
            # a lease that is gone joins again: docs/worker-protocol.md)
            threading.Thread(target=self._stop_after_leaving, args=(worker_id,), daemon=True).start()
            self._count(action)
        elif action == "kill":
            stop(self.workers[worker_id], signal.SIGKILL)
            self._count("kill")

    def _stop_after_leaving(self, worker_id: str) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not self.stopped.is_set():
            try:
                listing = httpx.get(
                    self.gateways.urls[0] + "/admin/replicas",
                    headers={"authorization": f"Bearer {ADMIN_TOKEN}"},
                    timeout=10,
                ).json()
                state = next((r["state"] for r in listing["data"] if r["id"] == worker_id), "left")
                if state != "serving" and state != "cordoned":
                    break
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                pass
            time.sleep(0.5)
        stop(self.workers[worker_id], signal.SIGTERM)

    def _count(self, kind: str) -> None:
        with self._lock:
            self.changes[kind] = self.changes.get(kind, 0) + 1

    def loop(self, every_s: float) -> threading.Thread:
        def run() -> None:
            while not self.stopped.wait(every_s * self.rng.uniform(0.5, 1.5)):
                try:
                    self.step()
                except Exception as exc:  # the churn goes on; the report names it
                    self.errors.append(repr(exc))

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        self.stopped.set()
        for process in self.workers.values():
            stop(process, signal.SIGTERM)


def run_churn(
    *,
    seconds: float = 600.0,
    clients_count: int = 24,
    gateways: int = 2,
    churn_every_s: float = 3.0,
    decode_ms: float = 10.0,
    seed: int = 1,
    workers: tuple[int, int] = (2, 6),
    sources_every_s: float | None = None,
    after: Callable[[str, list[Record]], None] | None = None,
) -> Verdict:
    """The whole soak, on a PostgreSQL of its own; returns the verdict (its table, its checks).
    ``sources_every_s``: how often a DNS record or the file changes (ops/churn_sources.py;
    default three churn steps; 0: never, as without dnsmasq).
    ``after(database_url, records)``: called once the verdict is in, before the database goes."""
    rng = random.Random(seed)
    workdir = Path(tempfile.mkdtemp(prefix="phasegate-churn-"))
    workdir.chmod(0o755)  # the embedded server's own user must enter it
    (workdir / "phasegate.toml").write_text(SETTINGS)
    database = EmbeddedPostgres(workdir / "pg")
    front: Gateways | None = None
    churn: Churn | None = None
    sources: Sources | None = None
    verdict = Verdict()
    every_s = 3 * churn_every_s if sources_every_s is None else sources_every_s
    binary = dnsmasq_binary() if every_s > 0 else None
    try:
        url = database.start()
        upgrade(url)
        if binary is not None:
            dns = Dns(binary, workdir)
            dns.start()
            admin = lambda: _listed(front)  # noqa: E731
            pids = lambda: front.serving_pids() if front else []  # noqa: E731
            sources = Sources(dns, workdir / "phasegate.toml", SETTINGS, _worker(decode_ms), _stop, admin, pids)
        front = live = Gateways(gateways, workdir / "phasegate.toml", url, ENV)
        live.wait_ready()
        churn = Churn(live, rng, decode_ms, *workers)
        for _ in range(workers[0] + 1):
            churn.join()
        samples: list[Sample] = []
        began = time.monotonic()
        done = threading.Event()
        disruptions: list[str] = []
        threads = [
            churn.loop(churn_every_s),
            _every(1.0, done, lambda: _sample(live, began, samples)),
            _once(seconds / 3, done, lambda: _restart_gateway(live, rng, disruptions)),
            _once(2 * seconds / 3, done, lambda: _restart_database(database, disruptions)),
        ]
        if sources is not None:
            sources.add_address()
            threads.append(_every(every_s, done, lambda: disruptions.append(sources.step(rng.choice))))
        records = asyncio.run(clients(live.urls, clients_count, seconds, rng))
        done.set()
        churn.stopped.set()
        for thread in threads:
            thread.join()
        asyncio.run(until_all_ended(url, timeout_s=60.0))
        front.close()
        front = None
        churn.close()
        verdict.fleet.update(churn.changes)
        verdict.fleet.update(disruptions)
        if sources is not None:
            verdict.fleet["dns add"] += 1  # the first address, at the start
            verdict.propagation = sources.report()
            verdict.problems += [f"note: {e}" for e in sources.errors[:10]]
        asyncio.run(check(url, records, BATCH_DELTAS, verdict))
        judge_rss(samples, time.monotonic() - began if not samples else samples[-1].at + 1e-6, verdict)
        verdict.problems += [f"note: fleet change refused: {e}" for e in churn.errors[:10]]
        if verdict.problems:
            asyncio.run(keep_evidence(url, verdict))
        if after is not None:
            after(url, records)
        return verdict
    finally:
        if front is not None:
            front.close(signal.SIGKILL)
        if churn is not None:
            churn.close()
        if sources is not None:
            sources.close()
        database.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def _worker(decode_ms: float) -> Callable[[str, int], subprocess.Popen[bytes]]:
    """Starts a sim worker that does not join (DNS or the file declare it), once it serves."""

    def started(host: str, port: int) -> subprocess.Popen[bytes]:
        command = phasegate("worker", "--engine", "sim", "--model", MODEL, "--host", host, "--port", str(port))
        command += ["--sim-decode-ms-per-token", str(decode_ms), "--heartbeat-ms", "200"]
        process = start([*command, "--max-running", "500", "--max-queued", "500"], ENV)
        wait_http(f"http://{host}:{port}/v1/health")
        return process

    return started


def _stop(process: subprocess.Popen[bytes]) -> None:
    stop(process, signal.SIGTERM)


def _listed(front: Gateways | None) -> list[dict[str, object]]:
    """The fleet as the first gateway's admin API lists it."""
    if front is None:
        return []
    auth = {"authorization": f"Bearer {ADMIN_TOKEN}"}
    listed: list[dict[str, object]] = httpx.get(front.urls[0] + "/admin/replicas", headers=auth, timeout=10).json()[
        "data"
    ]
    return listed


async def keep_evidence(database_url: str, verdict: Verdict) -> None:
    """The log of every request a check failed on, as a trace ``phasegate replay`` reads,
    under ``artifacts/churn/`` (the database goes with the run)."""
    failing = sorted({rid for p in verdict.problems if not p.startswith("note") for rid in re.findall(_ID, p)})
    if not failing:
        return
    folder = REPO / "artifacts" / "churn" / time.strftime("%Y%m%dT%H%M%S")
    folder.mkdir(parents=True, exist_ok=True)
    store = await PostgresEventStore.connect(database_url)
    try:
        for request_id in failing[:50]:
            trace = dump_trace(await store.read(request_id), {"source": "churn"})
            (folder / f"{request_id}.jsonl").write_text("".join(trace))
    finally:
        await store.close()
    (folder / "problems.txt").write_text("\n".join(verdict.problems) + "\n")
    verdict.problems.append(f"note: the failing requests' logs are in {folder}")


_ID = r"req_[0-9a-f]{24}"


def _every(interval_s: float, done: threading.Event, action: Callable[[], object]) -> threading.Thread:
    def run() -> None:
        while not done.wait(interval_s):
            action()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _once(after_s: float, done: threading.Event, action: Callable[[], object]) -> threading.Thread:
    def run() -> None:
        if not done.wait(after_s):
            action()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _sample(front: Gateways, began: float, samples: list[Sample]) -> None:
    at = time.monotonic() - began
    for index, incarnation in enumerate(front.incarnations):
        if front.processes[index].poll() is None:
            samples.append(Sample(index, incarnation, at, front.rss_kib(index)))


def _restart_gateway(front: Gateways, rng: random.Random, disruptions: list[str]) -> None:
    front.restart(rng.randrange(len(front.urls)))
    disruptions.append("gateway restart")


def _restart_database(database: EmbeddedPostgres, disruptions: list[str]) -> None:
    database.restart(mode="fast")
    disruptions.append("postgres restart")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=600.0, help="how long the traffic runs")
    parser.add_argument("--clients", type=int, default=24)
    parser.add_argument("--gateways", type=int, default=2, help="gateway instances sharing the log (2 or more)")
    parser.add_argument("--churn-every", type=float, default=3.0, help="seconds between fleet changes (jittered)")
    parser.add_argument("--decode-ms", type=float, default=10.0, help="the sim workers' time per token")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--sources-every", type=float, help="seconds between DNS changes and reloads (0: none; default 3 churn steps)"
    )
    options = parser.parse_args()
    if options.gateways < 2:
        parser.error("--gateways: 2 or more (one is restarted during the run)")
    began = time.monotonic()
    verdict = run_churn(
        seconds=options.seconds,
        clients_count=options.clients,
        gateways=options.gateways,
        churn_every_s=options.churn_every,
        decode_ms=options.decode_ms,
        seed=options.seed,
        sources_every_s=options.sources_every,
    )
    print(verdict.table())
    print(f"{'took':<14} {time.monotonic() - began:>6.0f} s")
    for problem in verdict.problems[:30]:
        print("  ", problem)
    print("PASS" if verdict.passed else "FAIL")
    sys.exit(0 if verdict.passed else 1)


if __name__ == "__main__":
    main()
