"""What the gateway adds: one sim worker reached directly and through the gateway, side by side.

    python ops/bench/overhead.py                         # 1, 100 and 1000 streams, then capacity
    python ops/bench/overhead.py --streams 1,100 --capacity 0

Everything is real and local: an embedded PostgreSQL (the commit point is durable,
as in production), one sim worker process, and the gateway in its own process
(``phasegate serve``), so its CPU time can be read from /proc. For each level of
concurrency the same requests run straight against the worker (the worker protocol,
parsed by the gateway's own client) and then through the gateway (SSE over HTTP,
parsed here). Each level is N clients sending requests back to back for a while (the
first request of each is a warm-up), so arrivals spread out as under steady load;
the figures are set side by side:

- added time to first token, p50 and p99 (gateway minus direct, at each percentile);
- inter-token gaps on both paths and their difference;
- the gateway's CPU per 1,000 forwarded tokens;
- capacity: the most streams one gateway process held open at once (all alive and
  receiving), by steps, with the gateway's resident memory and the CPU share (cores)
  of the gateway, the worker behind the held streams, and this process (the clients). Held streams
  go to a second sim worker that decodes slowly (1 token/s by default: an open stream,
  not a flood of tokens), opened 100 a second; a stream that failed says why (one whose answer simply ended
  counts as completed). Open streams that received nothing in the last three token times are
  "silent", and those that received nothing at all "unanswered". Resident memory is given per
  held stream over the gateway's before the first level. With ``--hold-upstream openai``
  the held streams go to a fake vLLM upstream instead (``ops/bench/fake_vllm.py``, an
  ``openai`` replica at the same token rate), which costs less per stream than a sim
  worker, so the gateway, not the worker behind it, is what a level measures.

"timed" counts the requests whose time to first token was measured (each client's
first request is a warm-up): where it is small, the level saturated the machine.

The load generator shares the machine's cores with the worker, the gateway and
PostgreSQL, so on two cores the high-concurrency figures are upper bounds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg
import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from app.replicas.base import Token  # noqa: E402
from app.replicas.worker_client import WorkerClient  # noqa: E402
from app.store.database import asyncpg_dsn  # noqa: E402
from app.store.embedded import EmbeddedPostgres  # noqa: E402
from app.store.migrate import upgrade  # noqa: E402
from ops.bench import fake_vllm  # noqa: E402
from ops.bench.measure import (  # noqa: E402
    Sample,
    closed_loop,
    cpu_seconds,
    error_code,
    ms,
    percentile,
    record,
    row,
    rss_mib,
)
from ops.processes import free_port, phasegate, running, start, stop, wait_http  # noqa: E402

MODEL = "sim"
HOLD_MODEL = "sim-hold"  # a second worker, slow, for the streams held open
API_KEY = ""  # --api-key: configured in the gateway and sent with every request


# --- the two paths ---------------------------------------------------------------------------


async def direct(worker_url: str, streams: int, tokens: int, seconds: float, sample: Sample) -> None:
    client = WorkerClient(worker_url, read_timeout=60.0)
    ids = iter(range(10**9))

    async def one(n: int, keep: bool) -> None:
        began, last = time.perf_counter(), None
        try:
            stream = await client.start(
                request_id=f"bench-direct-{time.monotonic_ns()}-{next(ids)}",
                attempt=1,
                lease_epoch=1,
                lease_ttl_s=30.0,
                model=MODEL,
                messages=[{"role": "user", "content": f"bench {n}"}],
                params={"max_tokens": tokens, "temperature": 0},
            )
            async for frame in stream:
                if type(frame) is Token:
                    last = record(sample, began, last, keep)
        except Exception as exc:
            sample.failed(type(exc).__name__)

    await closed_loop(streams, seconds, one)
    await client.aclose()


def gateway_client(gateway_url: str, streams: int, timeout: float) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=streams)
    headers = {"Authorization": f"Bearer {API_KEY}"} if API_KEY else None
    return httpx.AsyncClient(base_url=gateway_url, timeout=timeout, limits=limits, headers=headers)


async def through_gateway(gateway_url: str, streams: int, tokens: int, seconds: float, sample: Sample) -> None:
    async with gateway_client(gateway_url, streams, 60.0) as http:

        async def one(n: int, keep: bool) -> None:
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"bench {n}"}],
                "stream": True,
                "max_tokens": tokens,
                "temperature": 0,
            }
            began, last = time.perf_counter(), None
            try:
                async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data: {") and '"content":' in line:
                            last = record(sample, began, last, keep)
            except Exception as exc:
                sample.failed(type(exc).__name__)

        await closed_loop(streams, seconds, one)


# --- capacity --------------------------------------------------------------------------------


async def hold(gateway_url: str, streams: int, seconds: float, ramp_per_s: float, quiet_s: float) -> Held:
    """Open ``streams`` long streams, ``ramp_per_s`` a second, then keep them open for
    ``seconds``; a stream is alive at the end if it received a chunk in the last ``quiet_s``."""
    held = Held(streams)
    receiving = [0.0] * streams
    async with gateway_client(gateway_url, streams, 120.0) as http:

        async def one(n: int) -> None:
            await asyncio.sleep(n / ramp_per_s)
            body = {
                "model": HOLD_MODEL,
                "messages": [{"role": "user", "content": f"hold {n}"}],
                "stream": True,
                "max_tokens": 4000,
            }
            why = "closed without [DONE]"
            try:
                async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                    if response.status_code != 200:
                        why = f"HTTP {response.status_code} {error_code(await response.aread())}"
                    async for line in response.aiter_lines():
                        if line.startswith("data: {"):
                            receiving[n] = time.monotonic()
                            if line.startswith('data: {"error"'):
                                why = f"error event {error_code(line[6:])}"
                        elif line == "data: [DONE]" and why == "closed without [DONE]":
                            why = ""
            except Exception as exc:
                why = type(exc).__name__
            if why:
                held.failed[why] = held.failed.get(why, 0) + 1
            else:
                held.completed += 1  # the sim's answer ended (16 to 128 tokens): not a failure

        tasks = [asyncio.create_task(one(n)) for n in range(streams)]
        await asyncio.sleep(streams / ramp_per_s + seconds)
        cutoff = time.monotonic() - quiet_s
        held.alive = sum(1 for at, task in zip(receiving, tasks, strict=True) if at > cutoff and not task.done())
        held.silent = sum(1 for at, task in zip(receiving, tasks, strict=True) if 0 < at <= cutoff and not task.done())
        held.unanswered = sum(1 for at, task in zip(receiving, tasks, strict=True) if at == 0 and not task.done())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return held


async def log_position(url: str) -> int:
    connection = await asyncpg.connect(asyncpg_dsn(url))
    try:
        return int(await connection.fetchval("SELECT coalesce(max(position), 0) FROM request_events"))
    finally:
        await connection.close()


async def upstream_failures(url: str, after: int) -> list[tuple[str, str, int]]:
    """How the held streams' attempts failed, from the log: the five commonest."""
    connection = await asyncpg.connect(asyncpg_dsn(url))
    try:
        rows = await connection.fetch(
            "SELECT body->>'kind' AS kind, left(body->>'detail', 70) AS detail, count(*) AS n"
            " FROM request_events WHERE type = 'UpstreamFailed' AND position > $1"
            " GROUP BY 1, 2 ORDER BY 3 DESC LIMIT 5",
            after,
        )
        return [(row["kind"], row["detail"], row["n"]) for row in rows]
    finally:
        await connection.close()


@dataclass
class Held:
    streams: int
    alive: int = 0  # open and receiving at the end
    silent: int = 0  # open, but nothing received in the last quiet_s
    unanswered: int = 0  # open, and nothing received yet
    completed: int = 0  # answered in full before the end
    failed: dict[str, int] = field(default_factory=dict)  # why -> how many

    @property
    def held(self) -> bool:
        return not self.failed and self.alive + self.completed == self.streams


# --- processes ---------------------------------------------------------------------------------


def sim_worker(port: int, model: str, decode_ms: float) -> list[str]:
    command = phasegate("worker", "--port", str(port), "--engine", "sim", "--model", model)
    command += ["--max-running", "8000", "--max-queued", "8000"]
    return [*command, "--sim-decode-ms-per-token", str(decode_ms), "--sim-prefill-ms-per-token", "0"]


@contextlib.contextmanager
def gateway_running(command: list[str], env: dict[str, str], log: Path | None) -> Iterator[subprocess.Popen[bytes]]:
    process = start(command, env, log)
    try:
        yield process
    finally:
        stop(process)


# --- the run ---------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", default="1,100,1000", help="concurrency levels")
    parser.add_argument("--tokens", type=int, default=50, help="tokens per stream")
    parser.add_argument("--decode-ms", type=float, default=20.0, help="the sim's time per token")
    parser.add_argument("--capacity", default="1000,1500,2000,2500", help="stream counts to hold open ('0': skip)")
    parser.add_argument("--seconds", type=float, default=10.0, help="how long each level runs on each path")
    parser.add_argument("--hold-s", type=float, default=15.0, help="how long the held streams stay open")
    parser.add_argument("--hold-decode-ms", type=float, default=1000.0, help="the held streams' time per token")
    parser.add_argument(
        "--hold-stall-s", type=float, default=10.0, help="the gateway's stall timeout (tokens come 1 s apart)"
    )
    parser.add_argument(
        "--connect-s", type=float, default=10.0, help="the gateway's connect timeout (a busy sim worker accepts late)"
    )
    parser.add_argument(
        "--lease-ttl-s", type=float, default=5.0, help="the attempts' lease (renewed in one round per worker)"
    )
    parser.add_argument("--ramp-per-s", type=float, default=100.0, help="held streams opened per second")
    parser.add_argument(
        "--hold-upstream",
        choices=("sim", "openai"),
        default="sim",
        help="the held streams' replica: a sim worker, or a fake vLLM upstream (an openai replica)",
    )
    parser.add_argument(
        "--api-key",
        default="",
        help="a key configured in the gateway and sent by the clients (none: the gateway is open, and checks"
        " PostgreSQL's key table every api_key_cache_s)",
    )
    parser.add_argument("--gateway-log", type=Path, help="append the gateway's output (warnings and up) here")
    options = parser.parse_args()
    global API_KEY
    API_KEY = options.api_key

    workdir = Path(tempfile.mkdtemp(prefix="phasegate-bench-"))
    workdir.chmod(0o755)  # the embedded server's own user must enter it
    database = EmbeddedPostgres(workdir / "pg")
    url = database.start()
    upgrade(url)
    worker_port, hold_port, gateway_port = free_port(), free_port(), free_port()
    worker_url, hold_url = f"http://127.0.0.1:{worker_port}", f"http://127.0.0.1:{hold_port}"
    gateway_url = f"http://127.0.0.1:{gateway_port}"
    worker_cmd = sim_worker(worker_port, MODEL, options.decode_ms)
    hold_openai = options.hold_upstream == "openai"
    if hold_openai:  # an OpenAI upstream in vLLM's chunks: cheaper per stream than a sim worker
        hold_cmd = fake_vllm.command(hold_port, HOLD_MODEL, token_ms=options.hold_decode_ms)
    else:
        hold_cmd = sim_worker(hold_port, HOLD_MODEL, options.hold_decode_ms)
    config = workdir / "gateway.toml"
    config.write_text(
        f'[models]\n"{MODEL}" = "bench"\n"{HOLD_MODEL}" = "bench"\n'
        f'[[replicas]]\nid = "w1"\nurl = "{worker_url}"\nmodels = ["{MODEL}"]\n'
        f'[[replicas]]\nid = "w2"\nurl = "{hold_url}"\nmodels = ["{HOLD_MODEL}"]\n'
        + ('kind = "openai"\n' if hold_openai else "")
        + f"[timeouts]\nstall_s = {options.hold_stall_s}\nconnect_s = {options.connect_s}\n"
        f"lease_ttl_s = {options.lease_ttl_s}\n"
        + (f'[api_keys]\n"{options.api_key}" = "bench"\n' if options.api_key else "")
    )
    gateway_cmd = phasegate("serve", "--processes", "1", "--port", str(gateway_port), "--log-level", "warning")
    gateway_cmd += ["--config", str(config)]
    try:
        with (
            running(worker_cmd) as _,
            running(hold_cmd) as hold_worker,
            gateway_running(gateway_cmd, {"DATABASE_URL": url}, options.gateway_log) as gateway,
        ):
            wait_http(worker_url + "/v1/ready")
            wait_http(hold_url + ("/health" if hold_openai else "/v1/ready"))
            wait_http(gateway_url + "/readyz")
            print(f"sim worker: {options.decode_ms:g} ms/token, {options.tokens} tokens a stream; commit point durable")
            print(row("streams", "path", "timed", "ttft p50", "ttft p99", "gap p50", "gap p99", "tokens", "fail"))
            rows = []
            for streams in [int(s) for s in options.streams.split(",") if s]:
                direct_sample, gateway_sample = Sample(), Sample()
                asyncio.run(direct(worker_url, streams, options.tokens, options.seconds, direct_sample))
                cpu_before = cpu_seconds(gateway.pid)
                asyncio.run(through_gateway(gateway_url, streams, options.tokens, options.seconds, gateway_sample))
                cpu_per_k = (cpu_seconds(gateway.pid) - cpu_before) / max(gateway_sample.tokens, 1) * 1000
                for name, sample in (("direct", direct_sample), ("gateway", gateway_sample)):
                    ttft, gaps = sample.ttft, sample.gaps
                    times = [
                        ms(percentile(ttft, 0.5)),
                        ms(percentile(ttft, 0.99)),
                        ms(percentile(gaps, 0.5)),
                        ms(percentile(gaps, 0.99)),
                    ]
                    print(row(streams, name, len(ttft), *times, sample.tokens, sample.failures))
                rows.append((streams, direct_sample, gateway_sample, cpu_per_k))
            print()
            print(row("streams", "+ttft p50", "+ttft p99", "+gap p50", "+gap p99", "cpu/1k tok"))
            for streams, d, g, cpu_per_k in rows:
                added = [
                    percentile(g.ttft, 0.5) - percentile(d.ttft, 0.5),
                    percentile(g.ttft, 0.99) - percentile(d.ttft, 0.99),
                ]
                added += [
                    percentile(g.gaps, 0.5) - percentile(d.gaps, 0.5),
                    percentile(g.gaps, 0.99) - percentile(d.gaps, 0.99),
                ]
                print(row(streams, *(ms(value) for value in added), f"{cpu_per_k * 1e3:.1f} ms"))
            levels = [int(s) for s in options.capacity.split(",") if s and s != "0"]
            if levels:
                time.sleep(10)  # the gateway closes the last level's streams meanwhile
                print()
                print(
                    f"held streams: {'a fake vLLM upstream' if hold_openai else 'a second sim worker'}"
                    f" at {options.hold_decode_ms:g} ms/token, "
                    f"{options.ramp_per_s:g} new streams/s, then {options.hold_s:g} s held; "
                    f"stall_s = {options.hold_stall_s:g}"
                )
                idle_mib = rss_mib(gateway.pid)
                print(f"gateway RSS before the first level: {idle_mib:.0f} MiB")
                heads = ["streams", "alive", "silent", "unanswered", "completed", "failed", "gateway RSS", "KiB/stream"]
                print(row(*heads, "gateway cpu", "worker cpu", "clients cpu"))
                processes = (gateway.pid, hold_worker.pid, os.getpid())
                for streams in levels:
                    log_before = asyncio.run(log_position(url))
                    cpu_before, began = [cpu_seconds(pid) for pid in processes], time.monotonic()
                    quiet_s = 3 * options.hold_decode_ms / 1000
                    held = asyncio.run(hold(gateway_url, streams, options.hold_s, options.ramp_per_s, quiet_s))
                    elapsed = time.monotonic() - began
                    used = [cpu_seconds(pid) - before for pid, before in zip(processes, cpu_before, strict=True)]
                    shares = [f"{seconds / elapsed:.2f}" for seconds in used]
                    failed = sum(held.failed.values())
                    rss = rss_mib(gateway.pid)
                    per_stream = f"{(rss - idle_mib) * 1024 / streams:.0f}"
                    counts = (held.alive, held.silent, held.unanswered, held.completed, failed)
                    print(row(streams, *counts, f"{rss:.0f} MiB", per_stream, *shares))
                    for why, count in sorted(held.failed.items(), key=lambda item: -item[1])[:5]:
                        print(f"{'':>12}{count} failed: {why}")
                    for kind, detail, count in asyncio.run(upstream_failures(url, log_before)):
                        print(f"{'':>12}{count} attempts failed: {kind} ({detail})")
                    if not held.held:
                        break
                    time.sleep(10)  # the gateway closes the last level's streams meanwhile
    finally:
        database.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
