"""Benchmark placement strategies on a multi-turn chat workload over real vLLM workers.

    python ops/bench/routing.py [--conversations 8] [--turns 6] [--concurrency 4]
        [--strategies least_outstanding,prefix_affinity,round_robin]
        [--vllm-python .venv-vllm/bin/python] [--model var/models/tiny-llama]

Two ``phasegate worker --engine vllm`` replicas serve the tiny local model with prefix
caching on and ``max_model_len`` 4096 (``.ci/vllm-env`` builds both). For each
strategy a gateway (``phasegate serve --processes 1``, the log on an embedded
PostgreSQL) fronts them. Then, when vllm-router is installed (``ops/bench/peers.py
--install``), two ``vllm serve`` replicas of the same model, fronted by vllm-router's
``cache_aware`` policy and by phasegate (``openai`` replicas), since vllm-router
cannot front phasegate workers. Through each front the workload runs: ``--conversations`` chats, each with
a system prompt of its own (``--system-words``, about 3 tokens a word here) and
``--turns`` user turns that each repeat the whole history, ``--concurrency`` chats
at a time, every answer streamed. Each strategy gets fresh text (a seed of its own),
so no cache carries over from the strategy before, after two unmeasured chats that
warm the gateway and the engines up.

Per strategy it prints:
- the prefix-cache hit rate: vLLM's own counters (``vllm:prefix_cache_hits`` over
  ``vllm:prefix_cache_queries``, in tokens) from each worker's /metrics, summed;
- TTFT p50 and p99, as the client saw it (the first content chunk);
- balance: the prompt tokens each replica took (``vllm:prompt_tokens``).
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
from dataclasses import dataclass
from pathlib import Path
from subprocess import Popen

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: ops/ is not installed

from app.store.embedded import EmbeddedPostgres
from app.store.migrate import upgrade
from ops.bench.measure import percentile, row
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
                for name in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:prompt_tokens")
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


@dataclass
class Front:
    """What the clients talk to: a gateway in front of the two replicas."""

    name: str
    port: int
    process: Popen[bytes]
    ready: str


def start_replicas(options: argparse.Namespace, workdir: Path, kind: str) -> tuple[list[str], list[Popen[bytes]]]:
    """Two replicas of the tiny model with prefix caching on: phasegate workers
    (``kind`` "worker") or ``vllm serve`` (``kind`` "openai")."""
    urls, processes = [], []
    for n in range(2):
        port = free_port()
        if kind == "worker":
            command = [options.vllm_python, "-m", "app.cli", "worker", "--port", str(port), "--engine", "vllm"]
            command += ["--model-path", options.model, "--max-model-len", "4096", "--dtype", "float32"]
            command += ["--max-running", "8", "--vllm-args", json.dumps({"enable_prefix_caching": True})]
            ready = "/v1/ready"
        else:
            command = [options.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--port", str(port)]
            command += ["--model", options.model, "--served-model-name", MODEL, "--max-model-len", "4096"]
            command += ["--dtype", "float32", "--max-num-seqs", "8", "--enable-prefix-caching"]
            ready = "/health"
        processes.append(start(command, env={"VLLM_CPU_KVCACHE_SPACE": "1"}, log=workdir / f"{kind}{n}.log"))
        urls.append(f"http://127.0.0.1:{port}")
    try:
        for url in urls:
            wait_http(url + ready, timeout=300)
    except RuntimeError:
        for process in processes:
            stop(process)
        raise RuntimeError(f"a vLLM replica did not get ready: see the logs in {workdir}") from None
    return urls, processes


def phasegate_gateway(workdir: Path, strategy: str, replicas: list[str], kind: str, database_url: str) -> Front:
    entries = "".join(
        f'\n[[replicas]]\nid = "r{n}"\nurl = "{url}"\nkind = "{kind}"\n' for n, url in enumerate(replicas, start=1)
    )
    config = workdir / f"{strategy}-{kind}.toml"
    config.write_text(f'[models]\n"{MODEL}" = "bench"\n{entries}\n[routing]\nstrategy = "{strategy}"\n')
    port = free_port()
    command = phasegate("serve", "--config", str(config), "--port", str(port), "--processes", "1")
    process = start(command, env={"DATABASE_URL": database_url}, log=workdir / f"gateway-{strategy}-{kind}.log")
    return Front(f"phasegate {strategy}", port, process, "/readyz")


def router_gateway(workdir: Path, replicas: list[str], router: Path) -> Front:
    port = free_port()
    command = [str(router), "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *replicas]
    command += ["--policy", "cache_aware", "--log-level", "warning"]
    return Front("vllm-router cache_aware", port, start(command, log=workdir / "vllm-router.log"), "/health")


def measure(front: Front, replicas: list[str], seed: int, options: argparse.Namespace) -> None:
    """Run the workload through ``front`` and print its row."""
    try:
        wait_http(f"http://127.0.0.1:{front.port}{front.ready}", timeout=120)
        warm = argparse.Namespace(**{**vars(options), "conversations": 2, "turns": 1})
        asyncio.run(workload(front.port, -seed, warm))  # unmeasured, text of its own: the first requests are slow
        before = scrape(replicas)
        ttfts, errors = asyncio.run(workload(front.port, seed, options))
        after = scrape(replicas)
    finally:
        stop(front.process)
    queries = sum(increase(before, after, "vllm:prefix_cache_queries"))
    hits = sum(increase(before, after, "vllm:prefix_cache_hits"))
    spread = "/".join(f"{n / 1000:.0f}k" for n in increase(before, after, "vllm:prompt_tokens"))
    rate = f"{hits / queries:.1%}" if queries else "n/a"
    p50, p99 = (f"{percentile(ttfts, q) * 1000:.1f} ms" if ttfts else "n/a" for q in (0.5, 0.99))
    print(row(front.name, rate, p50, p99, spread, len(errors), width=WIDTH), flush=True)
    for error in sorted(set(errors)):
        print(f"  {front.name}: {errors.count(error)} x {error}")


WIDTH = 24


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
    parser.add_argument(
        "--router",
        default=str(Path.home() / ".cache/phasegate-peers/vllm-router/bin/vllm-router"),
        help="vllm-router (ops/bench/peers.py --install puts it here); missing: that part is skipped",
    )
    options = parser.parse_args()
    if not Path(options.vllm_python).exists() or not Path(options.model).exists():
        raise SystemExit(f"needs {options.vllm_python} and {options.model}: run .ci/vllm-env first")

    workdir = Path(tempfile.mkdtemp(prefix="phasegate-routing-"))
    workdir.chmod(0o755)  # the embedded server's own user must enter it
    database = EmbeddedPostgres(workdir / "pg")
    try:
        url = database.start()
        upgrade(url)
        print(
            f"{options.conversations} chats x {options.turns} turns, {options.concurrency} at a time;"
            f" system prompt {options.system_words} words, turns {options.user_words} words,"
            f" {options.max_tokens} tokens an answer; 2 vLLM replicas of the tiny model (prefix caching on)",
            flush=True,
        )
        header = ("in front", "prefix-cache hits", "TTFT p50", "TTFT p99", "prompt tokens each", "errors")
        print(row(*header, width=WIDTH))
        strategies = options.strategies.split(",")
        replicas, processes = start_replicas(options, workdir, "worker")
        try:  # phasegate workers, each strategy
            for seed, strategy in enumerate(strategies, start=1):
                measure(phasegate_gateway(workdir, strategy, replicas, "worker", url), replicas, seed, options)
        finally:
            for process in processes:
                stop(process)
        if not Path(options.router).exists():
            print(f"vllm-router: skipped: {options.router} is not there (ops/bench/peers.py --install)")
            return
        replicas, processes = start_replicas(options, workdir, "openai")
        try:  # vllm serve replicas: vllm-router's cache-aware policy, and phasegate in front of the same
            measure(router_gateway(workdir, replicas, Path(options.router)), replicas, 100, options)
            for seed, strategy in enumerate(strategies[:2], start=101):
                measure(phasegate_gateway(workdir, strategy, replicas, "openai", url), replicas, seed, options)
        finally:
            for process in processes:
                stop(process)
    finally:
        database.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
