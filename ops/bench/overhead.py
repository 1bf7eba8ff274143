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
  receiving), by steps, with the gateway's resident memory.

The load generator shares the machine's cores with the worker, the gateway and
PostgreSQL, so on two cores the high-concurrency figures are upper bounds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from app.replicas.base import Token  # noqa: E402
from app.replicas.worker_client import WorkerClient  # noqa: E402
from app.store.embedded import EmbeddedPostgres  # noqa: E402
from app.store.migrate import upgrade  # noqa: E402
from ops.processes import free_port, phasegate, running, wait_http  # noqa: E402

MODEL = "sim"
TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class Sample:
    ttft: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    failures: int = 0


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# --- the two paths ---------------------------------------------------------------------------


async def closed_loop(streams: int, seconds: float, one_request) -> None:  # type: ignore[no-untyped-def]
    """``streams`` clients, each sending requests back to back until ``seconds`` passed;
    arrivals spread out after the first round, as they do under steady load."""
    stop = time.monotonic() + seconds

    async def client(n: int) -> None:
        await asyncio.sleep(n * 0.02 / max(streams, 1))  # a ramp, not one burst
        rounds = 0
        while time.monotonic() < stop:
            await one_request(n, rounds > 0)  # the first request of each client warms up
            rounds += 1

    await asyncio.gather(*(client(n) for n in range(streams)))


def record(sample: Sample, began: float, last: float | None, keep: bool) -> float:
    now = time.perf_counter()
    if keep:
        if last is None:
            sample.ttft.append(now - began)
        else:
            sample.gaps.append(now - last)
    sample.tokens += 1
    return now


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
        except Exception:
            sample.failures += 1

    await closed_loop(streams, seconds, one)
    await client.aclose()


async def through_gateway(gateway_url: str, streams: int, tokens: int, seconds: float, sample: Sample) -> None:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=streams)
    async with httpx.AsyncClient(base_url=gateway_url, timeout=60.0, limits=limits) as http:

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
            except Exception:
                sample.failures += 1

        await closed_loop(streams, seconds, one)


# --- capacity --------------------------------------------------------------------------------


async def hold(gateway_url: str, streams: int, seconds: float) -> tuple[int, int]:
    """Open ``streams`` long streams at once; how many were alive and receiving at the end."""
    receiving = [0] * streams
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=streams)
    async with httpx.AsyncClient(base_url=gateway_url, timeout=120.0, limits=limits) as http:

        async def one(n: int) -> None:
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"hold {n}"}],
                "stream": True,
                "max_tokens": 4000,
            }
            with contextlib.suppress(Exception):
                async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data: {"):
                            receiving[n] = time.monotonic()

        tasks = [asyncio.create_task(one(n)) for n in range(streams)]
        await asyncio.sleep(seconds)
        cutoff = time.monotonic() - 5.0
        alive = sum(1 for at in receiving if at > cutoff)
        failed = sum(1 for task in tasks if task.done())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return alive, failed


# --- processes ---------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}ms"


def row(*cells: object) -> str:
    return " ".join(f"{cell!s:>11}" for cell in cells)


# --- the run ---------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", default="1,100,1000", help="concurrency levels")
    parser.add_argument("--tokens", type=int, default=50, help="tokens per stream")
    parser.add_argument("--decode-ms", type=float, default=20.0, help="the sim's time per token")
    parser.add_argument("--capacity", default="500,1000,2000,3000", help="stream counts to hold open ('0': skip)")
    parser.add_argument("--seconds", type=float, default=10.0, help="how long each level runs on each path")
    parser.add_argument("--hold-s", type=float, default=15.0)
    options = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="phasegate-bench-"))
    workdir.chmod(0o755)  # the embedded server's own user must enter it
    database = EmbeddedPostgres(workdir / "pg")
    url = database.start()
    upgrade(url)
    worker_port, gateway_port = free_port(), free_port()
    worker_url, gateway_url = f"http://127.0.0.1:{worker_port}", f"http://127.0.0.1:{gateway_port}"
    worker_cmd = phasegate("worker", "--port", str(worker_port), "--engine", "sim")
    worker_cmd += ["--model", MODEL, "--max-running", "8000", "--max-queued", "8000"]
    worker_cmd += ["--sim-decode-ms-per-token", str(options.decode_ms), "--sim-prefill-ms-per-token", "0"]
    gateway_cmd = phasegate("serve", "--port", str(gateway_port), "--log-level", "warning")
    gateway_cmd += ["--replica", f"worker={worker_url}#w1", "--model", f"{MODEL}=bench"]
    try:
        with running(worker_cmd) as _, running(gateway_cmd, {"DATABASE_URL": url}) as gateway:
            wait_http(worker_url + "/v1/ready")
            wait_http(gateway_url + "/readyz")
            print(f"sim worker: {options.decode_ms:g} ms/token, {options.tokens} tokens a stream; commit point durable")
            print(row("streams", "path", "ttft p50", "ttft p99", "gap p50", "gap p99", "tokens", "fail"))
            rows = []
            for streams in [int(s) for s in options.streams.split(",") if s]:
                direct_sample, gateway_sample = Sample(), Sample()
                asyncio.run(direct(worker_url, streams, options.tokens, options.seconds, direct_sample))
                cpu_before = cpu_seconds(gateway.pid)
                asyncio.run(through_gateway(gateway_url, streams, options.tokens, options.seconds, gateway_sample))
                cpu_per_k = (cpu_seconds(gateway.pid) - cpu_before) / max(gateway_sample.tokens, 1) * 1000
                for name, sample in (("direct", direct_sample), ("gateway", gateway_sample)):
                    ttft, gaps = sample.ttft, sample.gaps
                    times = [ms(pct(ttft, 0.5)), ms(pct(ttft, 0.99)), ms(pct(gaps, 0.5)), ms(pct(gaps, 0.99))]
                    print(row(streams, name, *times, sample.tokens, sample.failures))
                rows.append((streams, direct_sample, gateway_sample, cpu_per_k))
            print()
            print(row("streams", "+ttft p50", "+ttft p99", "+gap p50", "+gap p99", "cpu/1k tok"))
            for streams, d, g, cpu_per_k in rows:
                added = [pct(g.ttft, 0.5) - pct(d.ttft, 0.5), pct(g.ttft, 0.99) - pct(d.ttft, 0.99)]
                added += [pct(g.gaps, 0.5) - pct(d.gaps, 0.5), pct(g.gaps, 0.99) - pct(d.gaps, 0.99)]
                print(row(streams, *(ms(value) for value in added), f"{cpu_per_k * 1e3:.1f} ms"))
            levels = [int(s) for s in options.capacity.split(",") if s and s != "0"]
            if levels:
                print()
                print(row("held", "alive", "ended", "gateway RSS"))
                for streams in levels:
                    alive, ended = asyncio.run(hold(gateway_url, streams, options.hold_s))
                    print(row(streams, alive, ended, f"{rss_mib(gateway.pid):.0f} MiB"))
                    if alive < streams:
                        break
                    time.sleep(2)
    finally:
        database.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
