"""phasegate from several source trees side by side, in one run: what a change bought.

    git archive <commit> | tar -x -C /tmp/before
    python ops/bench/trees.py before=/tmp/before after=.            # 3 alternating rounds
    python ops/bench/trees.py before=/tmp/before after=. --rounds 5 --seconds 10

On a machine shared with other work, two runs of ``ops/bench/peers.py`` minutes apart
differ by more than most changes do. Here every tree's gateway (``phasegate serve
--processes 1``, started from that tree) runs at once, in front of one fake vLLM
upstream and one embedded PostgreSQL (as ``peers.py`` sets them up): first paired
requests at one stream (direct, then each tree, in turn), then rounds at ``--streams``
in which direct and each tree run one after another, so that every tree sees the
machine as it was. It prints each round and the medians: requests per second, added
TTFT (p50, and p99 in each round), the added inter-token gap (p50), and the gateway's CPU
per 1,000 forwarded tokens (its process tree).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from app.store.embedded import EmbeddedPostgres  # noqa: E402
from app.store.migrate import upgrade  # noqa: E402
from ops.bench import fake_vllm  # noqa: E402
from ops.bench.gateways import API_KEY, HOST, MODEL, Peer, wait_serving  # noqa: E402
from ops.bench.measure import Sample, added_ms, ms, percentile, rss_mib, tree_cpu_seconds  # noqa: E402
from ops.bench.peers import loaded  # noqa: E402
from ops.bench.sse_load import ChatClient  # noqa: E402
from ops.processes import free_port, start, stop  # noqa: E402


def gateway(name: str, tree: Path, config: Path, database_url: str, workdir: Path) -> Peer:
    port = free_port()
    command = [sys.executable, "-m", "app.cli", "serve", "--config", str(config), "--port", str(port)]
    command += ["--log-level", "warning", "--processes", "1"]
    with (workdir / f"{name}.log").open("ab") as log:
        process = subprocess.Popen(
            command,
            cwd=tree,  # python -m imports the tree's own app package
            env={**os.environ, "DATABASE_URL": database_url},
            start_new_session=True,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    return Peer(name, port, process, str(tree))


async def paired(ports: list[int], pairs: int, tokens: int) -> list[Sample]:
    clients = [ChatClient(HOST, port, MODEL, tokens, API_KEY) for port in ports]
    samples = [Sample() for _ in ports]
    for n in range(pairs + 3):
        for client, sample in zip(clients, samples, strict=True):
            await client.chat(n, sample, n >= 3)
    for client in clients:
        await client.close()
    return samples


def durable_append_ms(port: int) -> str:
    """The mean of the durable appends a gateway waited for so far, from its /metrics."""
    text = httpx.get(f"http://{HOST}:{port}/metrics", timeout=10).text
    values = {}
    for line in text.splitlines():
        for part in ("sum", "count"):
            if line.startswith(f'phasegate_eventlog_append_seconds_{part}{{durable="true"}}'):
                values[part] = float(line.split()[-1])
    if not values.get("count"):
        return "-"
    return f"{values['sum'] / values['count'] * 1000:.2f}ms over {values['count']:.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trees", nargs="+", help="name=path of a source tree")
    parser.add_argument("--streams", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=6.0, help="each run at --streams")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=40, help="paired requests at one stream (0: none)")
    parser.add_argument("--tokens", type=int, default=32)
    options = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="phasegate-trees-"))
    workdir.chmod(0o755)  # the embedded server's own user must enter it
    database = EmbeddedPostgres(workdir / "pg")
    upstream_port = free_port()
    upstream_cmd = fake_vllm.command(upstream_port, MODEL)
    upstream = start(upstream_cmd, log=workdir / "upstream.log")
    gateways: list[Peer] = []
    try:
        upgrade(database.start())
        wait_serving(Peer("fake vLLM", upstream_port, upstream, ""))
        config = workdir / "phasegate.toml"
        config.write_text(
            f'content_policy = "full"\n[models]\n"{MODEL}" = "bench"\n'
            f'[[replicas]]\nid = "fake-vllm"\nurl = "http://{HOST}:{upstream_port}"\nkind = "openai"\n'
        )
        for spec in options.trees:
            name, _, path = spec.partition("=")
            gateways.append(gateway(name, Path(path).resolve(), config, database.url, workdir))
            wait_serving(gateways[-1])
        if options.pairs:
            ports = [upstream_port] + [g.port for g in gateways]
            direct, *through = asyncio.run(paired(ports, options.pairs, options.tokens))
            base_ttft, base_gap = percentile(direct.ttft, 0.5), percentile(direct.gaps, 0.5)
            pairs = list(zip(gateways, through, strict=True))
            cells = [f"{g.name} {added_ms(percentile(s.ttft, 0.5) - base_ttft)}" for g, s in pairs]
            gaps = [f"{g.name} {added_ms(percentile(s.gaps, 0.5) - base_gap)}" for g, s in pairs]
            print(f"1 stream: direct TTFT p50 {ms(base_ttft)}; added: {', '.join(cells)}; gap: {', '.join(gaps)}")
            appends = [f"{g.name} {durable_append_ms(g.port)}" for g in gateways]
            print(f"1 stream: durable appends (the commit point's, the end's), mean: {', '.join(appends)}")
        figures: dict[str, list[tuple[float, float, float]]] = {g.name: [] for g in gateways}
        for round_ in range(options.rounds):
            sample, elapsed = asyncio.run(loaded(upstream_port, options.streams, options.seconds, options.tokens))
            direct_rate, direct_ttft = sample.requests / elapsed, percentile(sample.ttft, 0.5)
            direct_p99, direct_gap = percentile(sample.ttft, 0.99), percentile(sample.gaps, 0.5)
            cells = [f"direct {direct_rate:.0f} req/s"]
            for g in gateways:
                before = tree_cpu_seconds(g.process.pid)
                sample, elapsed = asyncio.run(loaded(g.port, options.streams, options.seconds, options.tokens))
                cpu = (tree_cpu_seconds(g.process.pid) - before) / max(sample.tokens, 1) * 1000
                rate, added = sample.requests / elapsed, percentile(sample.ttft, 0.5) - direct_ttft
                added_p99, added_gap = (
                    percentile(sample.ttft, 0.99) - direct_p99,
                    percentile(sample.gaps, 0.5) - direct_gap,
                )
                figures[g.name].append((rate, 100 * rate / direct_rate, cpu))
                ttft = f"TTFT {added_ms(added)} (p99 {added_ms(added_p99)}), gap {added_ms(added_gap)}"
                cells.append(
                    f"{g.name} {rate:.0f} req/s ({100 * rate / direct_rate:.0f} %), {ttft},"
                    f" {cpu:.3f} s/1k tok, {sample.failures} failed"
                )
            print(f"round {round_ + 1} at {options.streams} streams: " + " | ".join(cells), flush=True)
        for g in gateways if options.rounds else ():
            rates, shares, cpus = (sorted(column) for column in zip(*figures[g.name], strict=True))
            middle = len(rates) // 2
            print(
                f"{g.name}: median {rates[middle]:.0f} req/s ({shares[middle]:.0f} % of direct),"
                f" {cpus[middle]:.3f} CPU s per 1k tokens; {rss_mib(g.process.pid):.0f} MiB resident"
            )
    finally:
        for g in gateways:
            stop(g.process)
        stop(upstream)
        database.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
