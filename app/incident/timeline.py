"""The replay report: a timeline table of one request, then its verdict.

How this works: the request's events are folded again here (the replay result keeps
only the final state) to know the phase after each event and the replica of each
attempt; each ``Decided`` row shows the recorded decision, and the first row of a
decision run that the policy would now decide differently says what it recomputes.
A log that breaks the state machine is drawn up to the event that broke it.

    time          +ms      phase     att  replica  event                          decision
    12:00:00.001      0.0  prefill   -    -        RequestAccepted model=tiny …
    12:00:00.002      1.0  prefill   -    -        Decided                        start_attempt(request_accepted) …
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from app.incident.describe import describe_decision, describe_event, plural
from statemachine import events as ev
from statemachine.errors import IllegalTransition
from statemachine.events import Event
from statemachine.policy_config import PolicyConfig
from statemachine.replay import DecisionRun, ReplayResult, decision_of, summary
from statemachine.request_state import RequestState
from statemachine.state import apply

HEADINGS = ("time", "+ms", "phase", "att", "replica", "event", "decision")


@dataclass(frozen=True, slots=True)
class TimelineRow:
    seq: int
    at: datetime
    offset_ms: float  # since the request was accepted
    phase: str  # after the event
    attempt: int | None
    replica: str | None
    event: str
    decision: str  # the recorded decision of a Decided row, and what replay recomputed if it differs


def timeline(
    events: Sequence[Event], result: ReplayResult | None
) -> tuple[list[TimelineRow], IllegalTransition | None]:
    """The rows of ``events``; with the illegal transition that ended them early, if one did."""
    runs = {run.seq: run for run in result.runs} if result is not None else {}
    rows: list[TimelineRow] = []
    if not events:
        return rows, None
    state = RequestState(request_id=events[0].request_id)
    start = events[0].occurred_at
    background = isinstance(events[0], ev.RequestAccepted) and events[0].background
    for event in events:
        try:
            state = apply(state, event)
        except IllegalTransition as exc:
            return rows, exc
        attempt = getattr(event, "attempt", None)
        found = state.attempt(attempt) if attempt is not None else None
        rows.append(
            TimelineRow(
                seq=event.seq,
                at=event.occurred_at,
                offset_ms=(event.occurred_at - start) / timedelta(milliseconds=1),
                phase=state.phase.value,
                attempt=attempt,
                replica=found.replica_id if found is not None else None,
                event=type(event).__name__
                if isinstance(event, ev.Decided)
                else describe_event(event, background=background),
                decision=_decision(event, runs.get(event.seq)),
            )
        )
    return rows, None


def _decision(event: Event, run: DecisionRun | None) -> str:
    if not isinstance(event, ev.Decided):
        return ""
    recorded = describe_decision(decision_of(event))
    if run is None or run.agrees:
        return recorded
    return f"{recorded}   << DIVERGES: recomputed {summary(run.recomputed)}"


def render_table(rows: Sequence[TimelineRow]) -> str:
    """The rows as a plain-text table with a heading, columns padded to fit."""
    cells = [HEADINGS] + [
        (
            row.at.strftime("%H:%M:%S.%f")[:-3],
            f"{row.offset_ms:.1f}",
            row.phase,
            str(row.attempt) if row.attempt is not None else "-",
            row.replica or "-",
            row.event,
            row.decision,
        )
        for row in rows
    ]
    widths = [max(len(line[column]) for line in cells) for column in range(len(HEADINGS))]
    lines = []
    for line in cells:
        padded = [
            cell.rjust(width) if column == 1 else cell.ljust(width)
            for column, (cell, width) in enumerate(zip(line, widths, strict=True))
        ]
        lines.append("  ".join(padded).rstrip())
    return "\n".join(lines)


def render_verdict(events: Sequence[Event], result: ReplayResult) -> str:
    """The lines after the table: counts, the policy replayed with, then the divergence or none."""
    versions = sorted({event.policy_version for event in events if isinstance(event, ev.Decided)})
    head = (
        f"request {result.request_id}: {plural(result.events, 'event')}, {plural(result.decisions, 'decision')}"
        f" (recorded by policy {', '.join(versions) or '-'}; replayed with {describe_config(result.config)})"
    )
    if result.divergence is None:
        return f"{head}\nno divergence"
    divergence = result.divergence
    lines = [head, f"first divergence at seq {divergence.seq}:"]
    lines.append("  recorded:   " + "; ".join(describe_decision(d) for d in divergence.recorded))
    lines.append("  recomputed: " + ("; ".join(describe_decision(d) for d in divergence.recomputed) or "no action"))
    later = sum(1 for run in result.runs if not run.agrees) - 1
    if later:
        lines.append(f"  ({later} later decision run(s) differ too)")
    return "\n".join(lines)


def describe_config(config: PolicyConfig) -> str:
    return ", ".join(f"{name}={getattr(config, name)}" for name in config.__dataclass_fields__)
