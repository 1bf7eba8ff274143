"""Replaying named requests, one report each: the timeline table, then the verdict."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TextIO

from app.incident.timeline import render_table, render_verdict, timeline
from statemachine.errors import IllegalTransition
from statemachine.events import Event
from statemachine.policy_config import PolicyConfig
from statemachine.replay import replay

OK, DIVERGED = 0, 1


def replay_report(
    streams: Sequence[Sequence[Event]], config: PolicyConfig | None, out: TextIO, *, timelines: bool
) -> int:
    """Replay each request's events with ``config`` (``None``: the defaults with the
    request's recorded budget) and report it to ``out``; 0 if none diverged."""
    status = OK
    for number, events in enumerate(streams):
        if number:
            out.write("\n")
        try:
            result = replay(events, config)
        except IllegalTransition as broken:
            rows, _ = timeline(events, None)
            if timelines:
                out.write(render_table(rows) + "\n")
            out.write(f"request {events[0].request_id}: the log breaks the state machine at seq {len(rows) + 1}\n")
            out.write(f"  {broken}\n")
            status = DIVERGED
            continue
        if timelines:
            rows, _ = timeline(events, result)
            out.write(render_table(rows) + "\n")
        out.write(render_verdict(events, result) + "\n")
        if result.divergence is not None:
            status = DIVERGED
    out.flush()
    return status
