"""Benchmark placement strategies on a multi-turn chat workload over real vLLM workers.

    python ops/bench/routing.py [--conversations 8] [--turns 6] [--concurrency 4]
        [--strategies least_outstanding,prefix_affinity,round_robin]
        [--vllm-python .venv-vllm/bin/python] [--model var/models/tiny-llama]

Two ``phasegate worker --engine vllm`` replicas serve the tiny local model with prefix
caching on and ``max_model_len`` 4096 (``.ci/vllm-env`` builds both). For each
strategy a gateway (``phasegate serve --processes 1``, the log on an embedded
PostgreSQL) fronts them, and the workload runs: ``--conversations`` chats, each with
a system prompt of its own (``--system-words``, about 3 tokens a word here) and
``--turns`` user turns that each repeat the whole history, ``--concurrency`` chats
at a time, every answer streamed. Each strategy gets fresh text (a seed of its own),
so no cache carries over from the strategy before, after two unmeasured chats that
warm the gateway and the engines up.

Per strategy it prints:
- the prefix-cache hit rate: vLLM's own counters (``vllm:prefix_cache_hits`` over
  ``vllm:prefix_cache_queries``, in tokens) from each worker's /metrics, summed;
- TTFT p50 and p99, as the client saw it (the first content chunk);
- balance: the attempts each worker admitted (``phasegate_worker_attempts_started``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: ops/ is not installed

from app.store.embedded import EmbeddedPostgres
from app.store.migrate import upgrade
from ops.bench.measure import pct, row
from ops.processes import REPO, free_port, phasegate, start, stop, wait_http

MODEL = "tiny-llama"
WORDS = (
    "alpha",
    "river",
    "stone",
    "market",
    "window",
    "garden",
    "silver",
    "engine",
    "paper",
    "orange",
    "music",
    "winter",
    "thunder",
    "pocket",
    "candle",
    "forest",
    "bridge",
    "rocket",
    "planet",
    "yellow",
    "harbor",
    "lantern",
    "meadow",
    "copper",
    "violet",
    "marble",
    "canyon",
    "falcon",
    "glacier",
    "island",
    "jungle",
    "kettle",
    "ladder",
    "mirror",
    "needle",
    "orchard",
    "pillow",
    "quarry",
    "saddle",
    "tunnel",
    "velvet",
    "walnut",
)
STRATEGIES = ("least_outstanding", "prefix_affinity", "round_robin")


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def metric_sum(body: str, name: str) -> float:
    """The sum of every sample of ``name`` (a counter: its ``_total`` samples) in a /metrics body."""
    total = 0.0
    for match in re.finditer(rf"^{re.escape(name)}(?:_total)?(?:{{[^}}]*}})? ([0-9.eE+-]+)$", body, re.M):
        total += float(match.group(1))
    return total


def scrape(urls: list[str]) -> list[dict[str, float]]:
    readings = []
    for url in urls:
        body = httpx.get(url + "/metrics", timeout=10).text
        readings.append(
            {
                name: metric_sum(body, name)
                for name in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "phasegate_worker_attempts_started")
            }
        )
    return readings


def increase(before: list[dict[str, float]], after: list[dict[str, float]], name: str) -> list[float]:
    """Per worker, how much counter ``name`` grew between two scrapes."""
    return [later[name] - earlier[name] for earlier, later in zip(before, after, strict=True)]


async def conversation(
    client: httpx.AsyncClient, rng: random.Random, options: argparse.Namespace, ttfts: list[float], errors: list[str]
) -> None:
    messages = [{"role": "system", "content": text(rng, options.system_words)}]
    for _ in range(options.turns):
        messages.append({"role": "user", "content": text(rng, options.user_words)})
        body = {"model": MODEL, "messages": messages, "stream": True, "max_tokens": options.max_tokens}
        began = time.perf_counter()
        first: float | None = None
        answer = []
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                errors.append(f"{response.status_code}: {(await response.aread())[:200]!r}")
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    errors.append(chunk["error"].get("code", "error"))
                    return
                delta = chunk["choices"][0]["delta"].get("content") if chunk.get("choices") else None
                if delta:
                    first = first or time.perf_counter()
                    answer.append(delta)
        if first is not None:
            ttfts.append(first - began)
        messages.append({"role": "assistant", "content": "".join(answer)})


async def workload(port: int, seed: int, options: argparse.Namespace) -> tuple[list[float], list[str]]:
    ttfts: list[float] = []
    errors: list[str] = []
    gate = asyncio.Semaphore(options.concurrency)

    async def one(n: int) -> None:
        async with gate:
            await conversation(client, random.Random(seed * 1000 + n), options, ttfts, errors)

    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
        await asyncio.gather(*(one(n) for n in range(options.conversations)))
    return ttfts, errors


def start_workers(options: argparse.Namespace, workdir: Path) -> tuple[list[str], list]:  # type: ignore[type-arg]
    urls, processes = [], []
    args = {"enable_prefix_caching": True}
    for n in range(2):
        port = free_port()
        command = [options.vllm_python, "-m", "app.cli", "worker", "--port", str(port), "--engine", "vllm"]
        command += ["--model-path", options.model, "--max-model-len", "4096", "--dtype", "float32"]
        command += ["--max-running", "8", "--vllm-args", json.dumps(args)]
        processes.append(start(command, env={"VLLM_CPU_KVCACHE_SPACE": "1"}, log=workdir / f"worker{n}.log"))
        urls.append(f"http://127.0.0.1:{port}")
    for url, process in zip(urls, processes, strict=True):
        try:
            wait_http(url + "/v1/ready", timeout=300)
        except RuntimeError:
            for p in processes:
                stop(p)
            raise RuntimeError(f"a vLLM worker did not get ready: see {workdir} ({process.args})") from None
    return urls, processes


def gateway_config(workdir: Path, strategy: str, workers: list[str]) -> Path:
    replicas = "".join(f'\n[[replicas]]\nid = "w{n}"\nurl = "{url}"\n' for n, url in enumerate(workers, start=1))
    path = workdir / f"{strategy}.toml"
    path.write_text(f'[models]\n"{MODEL}" = "bench"\n{replicas}\n[routing]\nstrategy = "{strategy}"\n')
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--system-words", type=int, default=600, help="each chat's own system prompt")
    parser.add_argument("--user-words", type=int, default=30)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--vllm-python", default=str(REPO / ".venv-vllm/bin/python"))
    parser.add_argument("--model", default=str(REPO / "var/models/tiny-llama"))
    options = parser.parse_args()
    if not Path(options.vllm_python).exists() or not Path(options.model).exists():
        raise SystemExit(f"needs {options.vllm_python} and {options.model}: run .ci/vllm-env first")

    workdir = Path(tempfile.mkdtemp(prefix="phasegate-routing-"))
    workdir.chmod(0o755)  # the embedded server's own user must enter it
    database = EmbeddedPostgres(workdir / "pg")
    workers: list = []  # type: ignore[type-arg]
    try:
        url = database.start()
        upgrade(url)
        worker_urls, workers = start_workers(options, workdir)
        print(
            f"{options.conversations} chats x {options.turns} turns, {options.concurrency} at a time;"
            f" system prompt {options.system_words} words, turns {options.user_words} words,"
            f" {options.max_tokens} tokens an answer; 2 vLLM workers (prefix caching on)",
            flush=True,
        )
        print(row("strategy", "hit rate", "TTFT p50", "TTFT p99", "per worker", "errors", width=18))
        for seed, strategy in enumerate(options.strategies.split(","), start=1):
            port = free_port()
            config = gateway_config(workdir, strategy, worker_urls)
            command = phasegate("serve", "--config", str(config), "--port", str(port), "--processes", "1")
            gateway = start(command, env={"DATABASE_URL": url}, log=workdir / f"gateway-{strategy}.log")
            try:
                wait_http(f"http://127.0.0.1:{port}/readyz", timeout=60)
                warm = argparse.Namespace(**{**vars(options), "conversations": 2, "turns": 1})
                asyncio.run(workload(port, -seed, warm))  # unmeasured, text of its own: the first requests are slow
                before = scrape(worker_urls)
                ttfts, errors = asyncio.run(workload(port, seed, options))
                after = scrape(worker_urls)
            finally:
                stop(gateway)
            queries = sum(increase(before, after, "vllm:prefix_cache_queries"))
            hits = sum(increase(before, after, "vllm:prefix_cache_hits"))
            spread = "/".join(f"{n:.0f}" for n in increase(before, after, "phasegate_worker_attempts_started"))
            rate = f"{hits / queries:.1%}" if queries else "n/a"
            p50, p99 = (f"{pct(ttfts, q) * 1000:.1f} ms" if ttfts else "n/a" for q in (0.5, 0.99))
            print(row(strategy, rate, p50, p99, spread, len(errors), width=18), flush=True)
            for error in sorted(set(errors)):
                print(f"  {strategy}: {errors.count(error)} x {error}")
    finally:
        for process in workers:
            stop(process)
        database.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
