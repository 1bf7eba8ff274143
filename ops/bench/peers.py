"""phasegate beside its peers, in front of one fake vLLM upstream, side by side in one run.

    python ops/bench/peers.py                       # the table: the floors, vllm-router, phasegate, LiteLLM
    python ops/bench/peers.py --install             # first create the peers' venvs (PyPI)
    python ops/bench/peers.py --saturation          # phasegate alone: --processes 1 against 2, pinned

The upstream (``ops/bench/fake_vllm.py``, its own process) streams vLLM's exact chunks:
first token after 20 ms, then one every 5 ms, 32 tokens. In front of it, each on its own
port: a null TCP relay (the floor of any gateway), two floors of phasegate's own stack
(``ops/bench/stack_floor.py``: uvicorn's httptools server and Starlette forwarding each
chunk, nothing else; written the ordinary way, and lean as phasegate writes its token
events), vllm-router (round robin) and the LiteLLM proxy when
their venvs exist (``--install`` creates them from PyPI under ``--venvs``; a peer that
is missing or fails to install is skipped, with the reason printed), and phasegate,
which fronts the upstream as an ``openai`` replica with its log on an embedded
PostgreSQL that this script starts (content policy ``full``, the commit point durable).

For each peer: a paired run at one stream (direct and gateway requests alternate inside
one run, so both see the same machine), then a run at 100 streams (N clients sending
requests back to back; each client's first request is a warm-up), beside one direct run
at 100. *Added* is the gateway's figure minus direct's. The CPU per 1,000 tokens counts
every process of the gateway (its process tree, via /proc), and for phasegate
PostgreSQL's processes are counted beside it, since the log is part of the cost, and
printed by kind of process too (its sessions, the WAL writer, autovacuum, …).

``--saturation`` measures what ``phasegate serve --processes N`` gives: for N = 1 and then
2, each gateway process pinned to its own core (the bench sets the affinity of every
thread of each process), the same many streams, and the requests and tokens per second
they carried. The clients, the upstream and PostgreSQL share the machine's cores with
the gateways, and so does anything else running on it: the script prints how busy the
machine was (all processes, /proc/stat) beside what the gateways used, so a ratio below N
can be read as what the machine allowed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from app.store.embedded import EmbeddedPostgres  # noqa: E402
from app.store.migrate import upgrade  # noqa: E402
from ops.bench import fake_vllm  # noqa: E402
from ops.bench.gateways import (  # noqa: E402
    API_KEY,
    HOST,
    INSTALL,
    MODEL,
    PEERS,
    Peer,
    install,
    start_peer,
    venv_of,
    wait_serving,
)
from ops.bench.measure import (  # noqa: E402
    Sample,
    closed_loop,
    cpu_by_kind,
    cpu_seconds,
    descendants,
    ms,
    percentile,
    row,
    rss_mib,
    tree_cpu_seconds,
)
from ops.bench.sse_load import ChatClient  # noqa: E402
from ops.processes import free_port, start, stop  # noqa: E402

# --- the runs ------------------------------------------------------------------------------------


async def paired(direct_port: int, gateway_port: int, pairs: int, tokens: int) -> tuple[Sample, Sample]:
    """One stream: a direct request, then one through the gateway, ``pairs`` times (after warm-ups)."""
    direct, gateway = Sample(), Sample()
    clients = [ChatClient(HOST, port, MODEL, tokens, API_KEY) for port in (direct_port, gateway_port)]
    for n in range(pairs + 3):
        await clients[0].chat(n, direct, n >= 3)
        await clients[1].chat(n, gateway, n >= 3)
    for client in clients:
        await client.close()
    return direct, gateway


async def loaded(port: int, streams: int, seconds: float, tokens: int) -> tuple[Sample, float]:
    """``streams`` clients back to back for ``seconds``: the sample and the seconds it took."""
    sample = Sample()
    clients = [ChatClient(HOST, port, MODEL, tokens, API_KEY) for _ in range(streams)]
    began = time.monotonic()
    await closed_loop(streams, seconds, lambda n, keep: clients[n].chat(n, sample, keep))
    elapsed = time.monotonic() - began
    for client in clients:
        await client.close()
    return sample, elapsed


def print_failures(sample: Sample, prefix: str = "") -> None:
    for why, count in sorted(sample.why.items(), key=lambda item: -item[1]):
        print(f"{'':>12}{prefix}{count} failed: {why}")


def machine_busy_seconds() -> float:
    """CPU seconds every process of the machine used so far (/proc/stat, all but idle and iowait)."""
    fields = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def postmaster_pid(database: EmbeddedPostgres) -> int:
    return int((database.pgdata / "postmaster.pid").read_text().split("\n", 1)[0])


def per_k(seconds: float, tokens: int, digits: int = 3) -> str:
    return f"{seconds / max(tokens, 1) * 1000:.{digits}f}"


@dataclass
class Result:
    name: str
    version: str
    one: tuple[Sample, Sample]
    many: Sample
    elapsed: float
    cpu_s: float
    pg_cpu_s: float | None


def table(results: list[Result], direct: Sample, direct_elapsed: float, streams: int) -> None:
    direct_rate = direct.requests / direct_elapsed
    print()
    print(f"direct at {streams} streams: {direct_rate:.0f} req/s, TTFT p50 {ms(percentile(direct.ttft, 0.5))}")
    heads = ["+ttft p50@1", f"req/s@{streams}", "% direct", f"+ttft p50@{streams}", f"+ttft p99@{streams}"]
    heads += ["+gap p50@1", f"+gap p50@{streams}", "cpu s/1k tok", "pg s/1k tok", "failed"]
    print(f"{'system':<30}", row(*heads, width=13))
    for result in results:
        (d1, g1), many = result.one, result.many
        rate = many.requests / result.elapsed
        cells = [
            ms(percentile(g1.ttft, 0.5) - percentile(d1.ttft, 0.5)),
            f"{rate:.0f}",
            f"{100 * rate / direct_rate:.1f}",
        ]
        cells += [ms(percentile(many.ttft, q) - percentile(direct.ttft, q)) for q in (0.5, 0.99)]
        cells += [
            ms(percentile(g1.gaps, 0.5) - percentile(d1.gaps, 0.5)),
            ms(percentile(many.gaps, 0.5) - percentile(direct.gaps, 0.5)),
        ]
        cells += [per_k(result.cpu_s, many.tokens)]
        cells += [per_k(result.pg_cpu_s, many.tokens) if result.pg_cpu_s is not None else "-"]
        cells += [f"{g1.failures + many.failures}"]
        print(f"{result.name + ' ' + result.version:<30}", row(*cells, width=13))


def compare(options: argparse.Namespace, upstream_port: int, workdir: Path, database: EmbeddedPostgres) -> None:
    url = database.url
    available = []
    for name in options.peers.split(","):
        if name in INSTALL:
            if options.install and not (venv_of(options.venvs, name) / "bin/python").exists():
                print(f"installing {name} into {venv_of(options.venvs, name)} …", flush=True)
                why = install(options.venvs, name)
                if why:
                    print(f"{name}: skipped: {why}")
                    continue
            if not (venv_of(options.venvs, name) / "bin/python").exists():
                print(f"{name}: skipped: not installed (run with --install; venvs in {options.venvs})")
                continue
        available.append(name)
    print(
        f"fake vLLM upstream: TTFT {options.ttft_ms:g} ms, {options.token_ms:g} ms/token, {options.tokens} tokens;"
        f" {options.pairs} pairs at 1 stream, {options.seconds:g} s at {options.streams} streams;"
        f" {os.cpu_count()} cores",
        flush=True,
    )
    direct, direct_elapsed = asyncio.run(loaded(upstream_port, options.streams, options.seconds, options.tokens))
    results = []
    for name in available:
        peer = start_peer(name, upstream_port, workdir, options, url)
        try:
            wait_serving(peer)
            one = asyncio.run(paired(upstream_port, peer.port, options.pairs, options.tokens))
            cpu_before, pg_before = tree_cpu_seconds(peer.process.pid), cpu_by_kind(postmaster_pid(database))
            many, elapsed = asyncio.run(loaded(peer.port, options.streams, options.seconds, options.tokens))
            cpu_s = tree_cpu_seconds(peer.process.pid) - cpu_before
            pg_kinds = _used_since(pg_before, cpu_by_kind(postmaster_pid(database)))
            pg_cpu_s = sum(pg_kinds.values()) if name == "phasegate" else None
            processes = len(peer.gateway_pids())
            rss = sum(rss_mib(pid) for pid in descendants(peer.process.pid))
            print(
                f"{name}: {processes} serving process(es), {rss:.0f} MiB resident in all;"
                f" {many.requests} requests at {options.streams}",
                flush=True,
            )
            if name == "phasegate":
                spent = ", ".join(f"{kind} {per_k(used, many.tokens, 4)}" for kind, used in pg_kinds.items() if used)
                print(f"phasegate: PostgreSQL's CPU per 1,000 tokens by process: {spent}", flush=True)
            label = f"{peer.version}, {processes} proc" if name == "phasegate" else peer.version
            results.append(Result(name, label, one, many, elapsed, cpu_s, pg_cpu_s))
        except RuntimeError as exc:
            print(f"{name}: skipped: {exc}; its log: {(workdir / f'{name}.log').read_text()[-600:]}")
        finally:
            stop(peer.process)
    table(results, direct, direct_elapsed, options.streams)
    for result in results:
        for sample in (result.one[1], result.many):
            print_failures(sample, f"{result.name}: ")


def _used_since(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds by kind of process between two readings, most first."""
    used = {kind: seconds - before.get(kind, 0.0) for kind, seconds in after.items()}
    return dict(sorted(used.items(), key=lambda item: -item[1]))


def readings(gateway: int, postgres: int, upstream: int) -> list[float]:
    """CPU seconds so far: the gateway's tree, PostgreSQL's, the load (this bench's clients
    and the upstream), the whole machine."""
    load = cpu_seconds(os.getpid()) + tree_cpu_seconds(upstream)
    return [tree_cpu_seconds(gateway), tree_cpu_seconds(postgres), load, machine_busy_seconds()]


def pin(pid: int, core: int) -> None:
    """Every thread of ``pid`` onto ``core`` (what ``taskset -a -p -c`` does)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        os.sched_setaffinity(int(task.name), {core})


def saturation(
    options: argparse.Namespace,
    upstream: subprocess.Popen[bytes],
    upstream_port: int,
    workdir: Path,
    database: EmbeddedPostgres,
) -> None:
    cores = sorted(os.sched_getaffinity(0))
    print(
        f"saturation: phasegate --processes N, each gateway process pinned to its own core of {cores};"
        f" {options.saturation_streams} streams for {options.seconds:g} s",
        flush=True,
    )
    heads = ["processes", "req/s", "tokens/s", "gw cores", "pg cores", "load cores", "others", "failed"]
    heads += ["tok/s/gw core"]
    print(row(*heads))
    rates: dict[int, list[float]] = {1: [], 2: []}
    for processes in [1, 2] * options.rounds:  # alternating, so both see the machine's changing load
        options.processes = processes
        peer = start_peer("phasegate", upstream_port, workdir, options, database.url)
        try:
            wait_serving(peer)
            gateways = peer.gateway_pids()
            for index, pid in enumerate(gateways):
                pin(pid, cores[index % len(cores)])
            pids = peer.process.pid, postmaster_pid(database), upstream.pid
            before, each_before = readings(*pids), [cpu_seconds(pid) for pid in gateways]
            sample, elapsed = asyncio.run(
                loaded(peer.port, options.saturation_streams, options.seconds, options.tokens)
            )
            used = [(b - a) / elapsed for a, b in zip(before, readings(*pids), strict=True)]
            each = [(cpu_seconds(pid) - b) / elapsed for pid, b in zip(gateways, each_before, strict=True)]
            used[3] -= sum(used[:3])  # what the rest of the machine used meanwhile
            rates[processes].append(sample.requests / elapsed)
            cells = [f"{rates[processes][-1]:.0f}", f"{sample.tokens / elapsed:.0f}"]
            cells += [f"{share:.2f}" for share in used] + [sample.failures]
            per_core = sample.tokens / elapsed / max(used[0], 0.01)
            print(
                row(len(gateways), *cells, f"{per_core:.0f}"),
                " each gateway:",
                " ".join(f"{c:.2f}" for c in each),
                flush=True,
            )
            print_failures(sample)
        finally:
            stop(peer.process)
    ratio = sum(rates[2]) / sum(rates[1])
    print(f"N=2 / N=1 saturation throughput: {ratio:.2f}× (over {options.rounds} alternating round(s) each)")
    print(
        "(cores: CPU seconds per second; load: this bench's clients and the fake upstream;"
        " others: every other process on the machine meanwhile; tok/s/gw core: tokens a second"
        " per core the gateways got, which says how throughput follows the cores the machine allowed)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peers", default=",".join(PEERS), help="which, of " + ", ".join(PEERS))
    parser.add_argument("--install", action="store_true", help="create the missing peers' venvs from PyPI")
    parser.add_argument("--venvs", type=Path, default=Path.home() / ".cache" / "phasegate-peers")
    parser.add_argument("--pairs", type=int, default=100, help="paired requests at one stream")
    parser.add_argument("--streams", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=10.0, help="how long each run at --streams lasts")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--ttft-ms", type=float, default=20.0)
    parser.add_argument("--token-ms", type=float, default=5.0)
    parser.add_argument("--processes", type=int, default=None, help="phasegate serve --processes (default: its own)")
    parser.add_argument("--saturation", action="store_true", help="phasegate --processes 1 against 2, pinned")
    parser.add_argument("--saturation-streams", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=2, help="--saturation: alternating rounds of N=1 and N=2")
    options = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="phasegate-peers-"))
    workdir.chmod(0o755)  # the embedded server's own user must enter it
    database = EmbeddedPostgres(workdir / "pg")
    upstream_port = free_port()
    upstream_cmd = fake_vllm.command(upstream_port, MODEL, ttft_ms=options.ttft_ms, token_ms=options.token_ms)
    upstream = start(upstream_cmd, log=workdir / "upstream.log")
    try:
        upgrade(database.start())
        wait_serving(Peer("fake vLLM", upstream_port, upstream, ""))
        if options.saturation:
            saturation(options, upstream, upstream_port, workdir, database)
        else:
            compare(options, upstream_port, workdir, database)
    finally:
        stop(upstream)
        database.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
