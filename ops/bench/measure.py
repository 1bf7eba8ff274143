"""What the benches share: samples of a streamed run, percentiles, error codes, a closed loop of clients,
CPU time of processes (and of whole process trees) from /proc, and the printing of rows."""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class Sample:
    """What the clients of one path saw: times to first token, gaps between tokens (both
    from timed requests only), tokens, finished requests and failures."""

    ttft: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    requests: int = 0
    failures: int = 0
    why: dict[str, int] = field(default_factory=dict)  # a failure's reason -> how many

    def failed(self, reason: str) -> None:
        self.failures += 1
        self.why[reason] = self.why.get(reason, 0) + 1


def error_code(body: str | bytes) -> str:
    """The OpenAI-style error's code in ``body``, else its first bytes."""
    try:
        return str(json.loads(body)["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return repr(body[:80])


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (0.5: the median), the benches' one definition; NaN for none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def record(sample: Sample, began: float, last: float | None, keep: bool) -> float:
    """A token arrived now: its time to first token or its gap is kept when ``keep``."""
    now = time.perf_counter()
    if keep:
        if last is None:
            sample.ttft.append(now - began)
        else:
            sample.gaps.append(now - last)
    sample.tokens += 1
    return now


async def closed_loop(streams: int, seconds: float, one_request: Callable[[int, bool], Awaitable[None]]) -> None:
    """``streams`` clients, each sending requests back to back until ``seconds`` passed;
    arrivals spread out after the first round, as they do under steady load. Each
    client's first request is a warm-up (``one_request(n, keep=False)``)."""
    stop = time.monotonic() + seconds

    async def client(n: int) -> None:
        await asyncio.sleep(n * 0.02 / max(streams, 1))  # a ramp, not one burst
        rounds = 0
        while time.monotonic() < stop:
            await one_request(n, rounds > 0)
            rounds += 1

    await asyncio.gather(*(client(n) for n in range(streams)))


def _stat(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def cpu_seconds(pid: int) -> float:
    """User and system CPU of one process."""
    fields = _stat(pid)
    return (int(fields[11]) + int(fields[12])) / TICKS


def descendants(pid: int) -> list[int]:
    """``pid`` and every live process under it."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                children.setdefault(int(_stat(int(entry.name))[1]), []).append(int(entry.name))
            except (OSError, IndexError):
                continue  # it ended meanwhile
    found, stack = [], [pid]
    while stack:
        current = stack.pop()
        found.append(current)
        stack.extend(children.get(current, ()))
    return found


def tree_cpu_seconds(pid: int) -> float:
    """User and system CPU of ``pid``'s process tree: every live process in it, plus the
    children each has reaped (so a process that ended between two readings still counts)."""
    total = 0
    for member in descendants(pid):
        try:
            fields = _stat(member)
        except OSError:
            continue
        total += sum(int(value) for value in fields[11:15])  # utime stime cutime cstime
    return total / TICKS


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}ms"


def added_ms(seconds: float) -> str:
    """A difference in milliseconds, signed: what a gateway added (or took off)."""
    return f"{seconds * 1e3:+.3f}ms"


def row(*cells: object, width: int = 11) -> str:
    return " ".join(f"{cell!s:>{width}}" for cell in cells)


def cpu_by_kind(pid: int) -> dict[str, float]:
    """CPU seconds of ``pid``'s process tree by what each process says it is: PostgreSQL's
    titles (``walwriter``, ``autovacuum worker``, ``io worker``, …; every session as
    "client backends"), and "postmaster, exited": ``pid``'s own and what its exited
    children used (its reaped time)."""
    kinds: dict[str, float] = {}
    for member in descendants(pid):
        try:
            fields = _stat(member)
            title = Path(f"/proc/{member}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue  # it exited meanwhile: its time reaches the postmaster's reaped time
        used = (int(fields[11]) + int(fields[12])) / TICKS
        if member == pid:
            kind, used = "postmaster, exited", used + (int(fields[13]) + int(fields[14])) / TICKS
        else:
            title = title.removeprefix("postgres: ").strip()
            session = "[local]" in title or re.search(r"\d+\.\d+\.\d+\.\d+|::1", title)
            kind = "client backends" if session else re.sub(r"\s*\d+$", "", title)
        kinds[kind] = kinds.get(kind, 0.0) + used
    return kinds
