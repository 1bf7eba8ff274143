"""Replaying many requests: ``phasegate replay --since …``, with a progress bar and a summary.

The requests are read from the log in chunks (:func:`app.store.queries.read_requests`)
and replayed one by one; a request whose log breaks the state machine is counted as
broken, not raised. Two rates are reported: end to end (reading included) and the
replay alone, so a slow night is told apart from a slow database.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TextIO

from app.incident.describe import plural
from statemachine.errors import IllegalTransition
from statemachine.events import Event
from statemachine.policy_config import PolicyConfig
from statemachine.replay import replay

BAR_WIDTH = 30


class Progress:
    """A progress bar on a terminal (redrawn in place), or a line per tenth done otherwise."""

    def __init__(self, total: int, stream: TextIO) -> None:
        self.total = total
        self.stream = stream
        self.tty = stream.isatty()
        self._shown = -1

    def update(self, done: int) -> None:
        if self.tty:
            filled = BAR_WIDTH * done // max(self.total, 1)
            bar = "#" * filled + "." * (BAR_WIDTH - filled)
            self.stream.write(f"\r[{bar}] {done}/{self.total} requests")
            self.stream.flush()
            return
        tenth = 10 * done // max(self.total, 1)
        if tenth != self._shown and (tenth > self._shown or done == self.total):
            self._shown = tenth
            self.stream.write(f"replayed {done}/{self.total} requests\n")
            self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


@dataclass
class BulkSummary:
    requests: int = 0
    events: int = 0
    diverged: list[tuple[str, str]] = field(default_factory=list)  # (request id, what differs)
    broken: list[tuple[str, str]] = field(default_factory=list)  # (request id, the illegal transition)
    seconds: float = 0.0  # end to end
    replay_seconds: float = 0.0  # in replay() alone

    @property
    def ok(self) -> bool:
        return not self.diverged and not self.broken

    def render(self) -> str:
        rate = self.events / self.seconds if self.seconds else 0.0
        replay_rate = self.events / self.replay_seconds if self.replay_seconds else 0.0
        lines = [
            f"replayed {plural(self.requests, 'request')}, {plural(self.events, 'event')} in {self.seconds:.2f} s"
            f" ({rate:,.0f} events/s; replay alone {replay_rate:,.0f} events/s)",
            f"diverged: {len(self.diverged)}, broken: {len(self.broken)}",
        ]
        lines += [f"  diverged {request_id} {what}" for request_id, what in self.diverged]
        lines += [f"  broken   {request_id}: {what}" for request_id, what in self.broken]
        return "\n".join(lines)


async def replay_many(
    streams: AsyncIterator[Sequence[Event]], total: int, config: PolicyConfig | None, progress: Progress | None
) -> BulkSummary:
    """Replay every request ``streams`` yields (``total`` of them, for the progress bar)."""
    summary = BulkSummary()
    started = time.perf_counter()
    async for events in streams:
        began = time.perf_counter()
        try:
            result = replay(events, config)
        except IllegalTransition as exc:
            summary.broken.append((events[0].request_id, str(exc)))
        else:
            if result.divergence is not None:
                summary.diverged.append((result.request_id, result.divergence.describe()))
        summary.replay_seconds += time.perf_counter() - began
        summary.requests += 1
        summary.events += len(events)
        if progress is not None:
            progress.update(summary.requests)
    summary.seconds = time.perf_counter() - started
    if progress is not None:
        if summary.requests != total:
            progress.update(summary.requests)
        progress.close()
    return summary
