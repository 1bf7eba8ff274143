"""Where PostgreSQL's CPU goes while phasegate serves at 100 streams, by what it does (perf).

    python ops/bench/pg_profile.py [--seconds 20] [--record-s 8] [--streams 100] [--processes N]

``pg_stat_statements`` says how long each statement took, waits included; this says what
PostgreSQL's sessions spent their CPU on. It starts what ``peers.py`` starts (an embedded
PostgreSQL, the fake vLLM upstream, ``phasegate serve`` in front of it) and loads the
gateway with ``--streams`` clients for ``--seconds``. After a few seconds of load it samples
the gateway's sessions with ``perf record -e cpu-clock --call-graph dwarf`` for
``--record-s`` seconds (the wheel's ``postgres`` is not stripped, and has no frame
pointers). It then prints each part's share of the samples, counted inclusive (a
sample under the trigger's executor start counts for both), and the functions that were
running when sampled.

It needs ``perf`` and the right to trace another user's processes (root, or
``kernel.perf_event_paranoid`` at most 1 with ``CAP_PERFMON``). The figures in
docs/performance.md ("PostgreSQL's CPU by function") come from it.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from app.store.embedded import EmbeddedPostgres  # noqa: E402
from app.store.migrate import upgrade  # noqa: E402
from ops.bench import fake_vllm  # noqa: E402
from ops.bench.gateways import MODEL, Peer, start_peer, wait_serving  # noqa: E402
from ops.bench.measure import Sample, descendants  # noqa: E402
from ops.bench.peers import loaded, postmaster_pid  # noqa: E402
from ops.processes import free_port, start, stop  # noqa: E402

TRIGGER = "AfterTriggerEndQuery"  # the AFTER … FOR EACH STATEMENT triggers: the projection


@dataclass(frozen=True)
class Part:
    label: str
    frame: str  # a sample counts for the part when this function is on its stack
    inside: str | None = None  # … and, if given, this one too
    outside: str | None = None  # … and, if given, not this one


PARTS = (
    Part("the projection trigger", TRIGGER),
    Part("- setting up its statements", "standard_ExecutorStart", inside=TRIGGER),
    Part("- its row updates", "ExecUpdate", inside=TRIGGER),
    Part("- its aggregates over the batch", "ExecAgg", inside=TRIGGER),
    Part("- its new read-model rows", "ExecInsert", inside=TRIGGER),
    Part("the log's rows going in", "ExecInsert", outside=TRIGGER),
    Part("- their index entries", "ExecInsertIndexTuples", outside=TRIGGER),
    Part("the instance guard", "ExecBSInsertTriggers"),
    Part("the commit's WAL flush", "XLogFlush"),
    Part("planning a statement again", "BuildCachedPlan"),
    Part("stored generated columns", "ExecComputeStoredGenerated"),
    Part("simple-protocol statements (BEGIN, COMMIT, COPY)", "exec_simple_query"),
    Part("reading from the gateway", "secure_read"),
    Part("writing to the gateway", "secure_write"),
)
_FRAME = re.compile(r"\s+[0-9a-f]+ (\S+?)(?:\+0x[0-9a-f]+)? \(")


def stacks_of(script: Iterable[str]) -> Iterator[list[str]]:
    """Each sample's functions, innermost first, from ``perf script``'s lines: a header
    line, then one indented line a frame, then a blank line."""
    stack: list[str] | None = None
    for line in script:
        if not line.strip():
            if stack is not None:
                yield stack
            stack = None
        elif not line[0].isspace():
            stack = []
        elif stack is not None and (frame := _FRAME.match(line)):
            stack.append(frame.group(1))
    if stack is not None:
        yield stack


@dataclass
class Profile:
    samples: int
    parts: list[tuple[str, float]]  # label, share of the samples
    running: list[tuple[str, float]]  # the innermost function, share of the samples


def profile(stacks: Iterable[list[str]], top: int = 15) -> Profile:
    """Each part's share of ``stacks``, and the functions most often running."""
    counted = collections.Counter[str]()
    running = collections.Counter[str]()
    samples = 0
    for stack in stacks:
        samples += 1
        on = set(stack)
        if stack:
            running[stack[0]] += 1
        for part in PARTS:
            if (
                part.frame in on
                and (part.inside is None or part.inside in on)
                and (part.outside is None or part.outside not in on)
            ):
                counted[part.label] += 1
    share = 1 / max(samples, 1)
    return Profile(
        samples,
        [(part.label, counted[part.label] * share) for part in PARTS],
        [(name, count * share) for name, count in running.most_common(top)],
    )


def report(found: Profile) -> None:
    print(f"\n{found.samples} samples of PostgreSQL's sessions; share of them, inclusive")
    for label, share in found.parts:
        print(f"  {label:<52} {share * 100:5.1f} %")
    print("\nrunning when sampled")
    for name, share in found.running:
        print(f"  {name:<52} {share * 100:5.1f} %")


def sessions(database: EmbeddedPostgres) -> list[int]:
    """The server's session processes (``postgres: … [local] …``)."""
    found = []
    for pid in descendants(postmaster_pid(database)):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
        except OSError:
            continue
        if b"[local]" in title:
            found.append(pid)
    return found


def record(pids: list[int], seconds: float, frequency: int, data: Path) -> None:
    command = ["perf", "record", "-e", "cpu-clock", "-F", str(frequency), "--call-graph", "dwarf,32768"]
    command += ["-p", ",".join(map(str, pids)), "-o", str(data), "--", "sleep", str(seconds)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0 or not data.exists():
        raise SystemExit(f"perf record failed ({done.returncode}): {done.stderr.strip()[-400:]}")


def run(options: argparse.Namespace, workdir: Path) -> None:
    database = EmbeddedPostgres(workdir / "pg")
    upstream_port = free_port()
    upstream = start(fake_vllm.command(upstream_port, MODEL), log=workdir / "upstream.log")
    gateway: Peer | None = None
    try:
        upgrade(database.start())
        wait_serving(Peer("fake vLLM", upstream_port, upstream, ""))
        gateway = start_peer("phasegate", upstream_port, workdir, options, database.url)
        wait_serving(gateway)
        load: list[tuple[Sample, float]] = []
        clients = threading.Thread(
            target=lambda: load.append(asyncio.run(loaded(gateway.port, options.streams, options.seconds, 32)))
        )
        clients.start()
        time.sleep(min(3.0, options.seconds / 4))  # the clients connected, the plans made
        record(sessions(database), options.record_s, options.frequency, workdir / "perf.data")
        clients.join()
        (sample, elapsed), *_ = load
        print(f"{sample.requests} requests at {options.streams} streams in {elapsed:.1f} s")
        script = subprocess.Popen(
            ["perf", "script", "-i", str(workdir / "perf.data")],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert script.stdout is not None
        report(profile(stacks_of(script.stdout)))
        script.wait()
    finally:
        if gateway is not None:
            stop(gateway.process)
        stop(upstream)
        database.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="how long the clients run")
    parser.add_argument("--record-s", type=float, default=8.0, help="how long perf samples, after a warm-up")
    parser.add_argument("--streams", type=int, default=100)
    parser.add_argument("--frequency", type=int, default=1999, help="samples a second")
    parser.add_argument("--processes", type=int, default=None, help="phasegate serve --processes")
    options = parser.parse_args()
    if shutil.which("perf") is None:
        raise SystemExit("perf is not installed (Debian: apt install linux-perf)")
    workdir = Path(tempfile.mkdtemp(prefix="phasegate-pg-profile-"))
    workdir.chmod(0o755)  # the embedded server's own user must enter it
    try:
        run(options, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
