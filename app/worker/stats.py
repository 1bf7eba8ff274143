"""The worker's counters: plain integers the token loop increments, read by /metrics."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class WorkerStats:
    """Counters read by /metrics at scrape time (no per-token metric calls)."""

    started: int = 0
    finished: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    stopped: dict[str, int] = field(default_factory=dict)
    lease_expiries: int = 0
    renew_calls: int = 0  # renew requests (a batched one counts once)
    leases_renewed: int = 0
    tokens_generated: int = 0
    tokens_published: int = 0
    frames_published: int = 0
