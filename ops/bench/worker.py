"""What the worker costs per token: the engine alone vs client → HTTP → worker → engine.

    python ops/bench/worker.py                      # sim; plus vLLM when the env names it
    PHASEGATE_VLLM_PYTHON=.venv-vllm/bin/python PHASEGATE_TINY_MODEL=var/models/tiny-llama \\
        python ops/bench/worker.py --requests 8

For each engine the same requests run twice, one after the other: in process straight
on the engine (``generate``, counting outputs), then through a real worker process with
the real client (every frame parsed). Reported: tokens/s and frames/s of each path, and
the time per token the worker path adds.

The worker's own cost is measured on the sim engine with zero prefill and decode time:
there the engine costs next to nothing, so what the worker path adds is the worker
(plus HTTP and the client's parsing). Set against the vLLM engine's time per token on
the tiny model, that gives the overhead ratio the issue bounds at 5%. The vLLM
end-to-end difference is printed as well; on a two-core machine it is mostly noise,
since vLLM's own processes take both cores.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from app.replicas.base import Token  # noqa: E402
from app.replicas.worker_client import WorkerClient  # noqa: E402
from app.worker.engine import Engine  # noqa: E402
from app.worker.protocol import AttemptSpec, Sampling  # noqa: E402


@dataclass
class Run:
    tokens: int
    frames: int
    seconds: float
    engine_cpu_s: float  # CPU of the process that holds the engine (alone: this one; else the worker)
    client_cpu_s: float = 0.0  # CPU of the client's process (through the worker only)

    @property
    def engine_cpu_us_per_token(self) -> float:
        return self.engine_cpu_s / self.tokens * 1e6

    @property
    def client_cpu_us_per_token(self) -> float:
        return self.client_cpu_s / self.tokens * 1e6

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def frames_per_s(self) -> float:
        return self.frames / self.seconds

    @property
    def us_per_token(self) -> float:
        return self.seconds / self.tokens * 1e6


def _spec(i: int, model: str, tokens: int) -> AttemptSpec:
    sampling = Sampling(max_tokens=tokens, temperature=0.0, seed=i, ignore_eos=True)
    return AttemptSpec(f"bench{i}", 1, 1, 60.0, model, None, f"benchmark prompt {i}", sampling, 0.25)


async def engine_alone(engine: Engine, model: str, requests: int, tokens: int, concurrency: int) -> Run:
    await engine.start()
    try:

        async def one(i: int) -> tuple[int, int]:
            count = frames = 0
            async for output in engine.generate(f"alone{i}", engine.prepare(_spec(i, model, tokens))):
                count += len(output.token_ids)
                frames += 1
            return count, frames

        await one(-1)  # warm up
        cpu, started = time.process_time(), time.perf_counter()
        results = await _bounded([one(i) for i in range(requests)], concurrency)
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    finally:
        await engine.close()
    return Run(sum(r[0] for r in results), sum(r[1] for r in results), seconds, cpu)


def process_cpu_s(pid: int) -> float:
    """CPU time of all threads of a process, from the scheduler's nanosecond counters."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


async def through_worker(
    base_url: str, worker_pid: int, model: str, requests: int, tokens: int, concurrency: int
) -> Run:
    client = WorkerClient(base_url, read_timeout=60.0)
    try:

        async def one(i: int) -> tuple[int, int]:
            count = frames = 0
            params = {"max_tokens": tokens, "temperature": 0.0, "seed": i, "ignore_eos": True}
            stream = await client.start(
                request_id=f"bench{i}-{time.monotonic_ns()}",
                attempt=1,
                lease_epoch=1,
                lease_ttl_s=60,
                model=model,
                prompt=f"benchmark prompt {i}",
                params=params,
            )
            async for frame in stream:
                if isinstance(frame, Token):
                    count += len(frame.token_ids)
                    frames += 1
            return count, frames

        await one(-1)  # warm up
        worker_cpu, client_cpu, started = process_cpu_s(worker_pid), time.process_time(), time.perf_counter()
        results = await _bounded([one(i) for i in range(requests)], concurrency)
        seconds = time.perf_counter() - started
        client_cpu, worker_cpu = time.process_time() - client_cpu, process_cpu_s(worker_pid) - worker_cpu
    finally:
        await client.aclose()
    return Run(sum(r[0] for r in results), sum(r[1] for r in results), seconds, worker_cpu, client_cpu)


async def _bounded(coros: list[Any], concurrency: int) -> list[Any]:
    gate = asyncio.Semaphore(concurrency)

    async def run(coro: Any) -> Any:
        async with gate:
            return await coro

    return await asyncio.gather(*(run(c) for c in coros))


@contextlib.contextmanager
def worker_process(python: str, args: list[str], env: dict[str, str]) -> Iterator[tuple[str, int]]:
    """A worker in its own process group on a free port; yields (base URL, pid); kills the group."""
    with tempfile.TemporaryDirectory() as tmp:
        ready = Path(tmp) / "ready.json"
        cmd = [python, "-m", "app.cli", "worker", "--port", "0", "--ready-file", str(ready), *args]
        log = open(Path(tmp) / "log", "wb")  # noqa: SIM115 (closed below)
        proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **env},
        )
        try:
            deadline = time.monotonic() + 300
            while not ready.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError((Path(tmp) / "log").read_text()[-3000:])
                time.sleep(0.05)
            url = f"http://127.0.0.1:{json.loads(ready.read_text())['port']}"
            while True:
                with contextlib.suppress(httpx.HTTPError):  # a loading engine may hold the GIL a while
                    if httpx.get(url + "/v1/ready", timeout=10).status_code == 200:
                        break
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError((Path(tmp) / "log").read_text()[-3000:])
                time.sleep(0.2)
            yield url, proc.pid
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            log.close()


def bench_sim(requests: int, tokens: int, concurrency: int) -> tuple[Run, Run]:
    from app.worker.sim import SimEngine, SimTiming

    alone = asyncio.run(engine_alone(SimEngine(timing=SimTiming(0.0, 0.0, 0.0)), "sim", requests, tokens, concurrency))
    args = ["--sim-prefill-ms-per-token", "0", "--sim-decode-ms-per-token", "0", "--max-running", "64"]
    with worker_process(sys.executable, args, {}) as (url, pid):
        via = asyncio.run(through_worker(url, pid, "sim", requests, tokens, concurrency))
    return alone, via


def bench_vllm(
    python: str, model: str, requests: int, tokens: int, concurrency: int, vllm_args: str
) -> tuple[Run, Run]:
    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    cmd = [
        python,
        __file__,
        "--engine-alone-vllm",
        model,
        "--requests",
        str(requests),
        "--tokens",
        str(tokens),
        "--concurrency",
        str(concurrency),
        "--vllm-args",
        vllm_args,
    ]
    out = subprocess.run(
        cmd,
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        check=True,
        start_new_session=True,
    )
    alone = Run(**json.loads(out.stdout.strip().splitlines()[-1]))
    args = [
        "--engine",
        "vllm",
        "--model-path",
        model,
        "--model",
        "tiny",
        "--max-running",
        str(max(concurrency, 2)),
        "--vllm-args",
        vllm_args,
    ]
    with worker_process(python, args, env) as (url, pid):
        via = asyncio.run(through_worker(url, pid, "tiny", requests, tokens, concurrency))
    return alone, via


def _vllm_alone_main(model: str, requests: int, tokens: int, concurrency: int, vllm_args: str) -> None:
    from app.worker.vllm_engine import VllmEngine

    engine = VllmEngine(model, models=("tiny",), max_num_seqs=max(concurrency, 2), extra_args=json.loads(vllm_args))
    run = asyncio.run(engine_alone(engine, "tiny", requests, tokens, concurrency))
    print(json.dumps(dataclasses.asdict(run)))


def _row(name: str, run: Run) -> str:
    rates = f"{run.tokens_per_s:>8.0f} tok/s {run.frames_per_s:>8.0f} frames/s"
    per_token = f"{run.us_per_token:>8.1f} µs/token wall, {run.engine_cpu_us_per_token:>7.1f} µs/token CPU"
    return f"  {name:<20} {rates} {per_token}"


def _report(title: str, alone: Run, via: Run) -> float:
    """Print one engine's figures; return the worker's own CPU per token."""
    worker_us = via.engine_cpu_us_per_token - alone.engine_cpu_us_per_token
    print(title)
    print(_row("engine alone", alone))
    print(_row("through the worker", via))
    print(f"  the worker's own CPU: {worker_us:.1f} µs per token (its process, less the engine's share there)")
    print(f"  the client's CPU (parse and all): {via.client_cpu_us_per_token:.1f} µs per token")
    return worker_us


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=0, help="per request (default: sim 2000, vllm 480)")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds: the table shows the fastest, the ratio is the median"
    )
    parser.add_argument("--vllm-args", default='{"enforce_eager": true}')
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--engine-alone-vllm", metavar="MODEL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine_alone_vllm:
        _vllm_alone_main(args.engine_alone_vllm, args.requests, args.tokens or 480, args.concurrency, args.vllm_args)
        return 0

    def best(runs: list[tuple[Run, Run]]) -> tuple[Run, Run]:
        return min((r[0] for r in runs), key=lambda r: r.seconds), min((r[1] for r in runs), key=lambda r: r.seconds)

    print(f"worker benchmark: {args.requests} requests per round, concurrency {args.concurrency}, {args.rounds} rounds")
    sim_runs = [bench_sim(args.requests, args.tokens or 2000, args.concurrency) for _ in range(args.rounds)]
    _report("sim engine (0 ms prefill and decode)", *best(sim_runs))

    python, model = os.environ.get("PHASEGATE_VLLM_PYTHON"), os.environ.get("PHASEGATE_TINY_MODEL")
    if args.skip_vllm or not python or not model:
        print("vllm engine: skipped (set PHASEGATE_VLLM_PYTHON and PHASEGATE_TINY_MODEL, see .ci/vllm-env)")
        return 0
    vllm_runs = [
        bench_vllm(python, model, args.requests, args.tokens or 480, args.concurrency, args.vllm_args)
        for _ in range(args.rounds)
    ]
    _report(f"vllm engine (tiny model, {args.vllm_args}), fastest round", *best(vllm_runs))
    ratios = []
    for alone, via in vllm_runs:
        worker_us = via.engine_cpu_us_per_token - alone.engine_cpu_us_per_token
        ratios.append(worker_us / alone.us_per_token)
        end_to_end = (via.us_per_token - alone.us_per_token) / alone.us_per_token
        print(
            f"  round: worker overhead / engine time per token = {worker_us:.1f} / "
            f"{alone.us_per_token:.0f} µs = {ratios[-1]:.1%}; end to end {end_to_end:+.1%}"
        )
    ratio = statistics.median(ratios)
    print(f"  median overhead ratio: {ratio:.1%} (bound 5%: {'OK' if ratio < 0.05 else 'OVER'})")
    return 0 if ratio < 0.05 else 1


if __name__ == "__main__":
    sys.exit(main())
