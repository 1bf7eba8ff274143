"""A request's life as an SVG timeline: pure, events (and their replay) in, markup out.

How this works: every event gets a column, in seq order, so that a burst of events a
millisecond apart stays as legible as a lease that expires five seconds later; times
that are not events (an attempt's lease end) are placed by interpolating between the
columns of the events around them. Lanes, top to bottom:

- **policy**: one diamond per ``Decided`` event; red where replay recomputes another
  decision for that run;
- **attempt N** (one lane each): a bar from its start to how it ended, the lease
  under it, marks for the first token, deliveries, tool calls, the failure, the fence
  (a hatched span until its release), the cancel and its acknowledgement, the lease
  expiry and the release;
- **client**: what the client got: the commit point (also a line across every lane:
  no retry to the right of it), each delivery with its text, and how the request ended.

Every mark is an element with ``data-mark`` (and ``data-attempt`` on attempt lanes) and
a ``<title>`` giving the event in words, so a browser test can find what was drawn.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from html import escape

from app.incident.describe import describe_decision, describe_event, plural, preview
from statemachine import events as ev
from statemachine.events import Event
from statemachine.replay import DecisionRun, ReplayResult, decision_of, summary
from statemachine.request_state import DEAD_KINDS

LEFT = 190  # the lane labels' column
COLUMN = 58  # between two events
RIGHT = 230  # room for the last labels and a lease that outlives the request
TOP = 64  # the axis
LANE = 74
COLOURS = {
    "completed": "#2e7d32",
    "failed": "#c62828",
    "cancelled": "#6d6d6d",
    "delivered": "#1565c0",
    "fence": "#ef6c00",
    "lease": "#8e8e8e",
    "decision": "#5e35b1",
    "diverged": "#d50000",
    "commit": "#1565c0",
}


@dataclass
class _Canvas:
    """Column positions of one request's events, and the SVG elements drawn so far."""

    events: Sequence[Event]
    parts: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.start = self.events[0].occurred_at
        self.times = [event.occurred_at for event in self.events]
        self.width = LEFT + COLUMN * (len(self.events) - 1) + RIGHT

    def x(self, seq: int) -> float:
        return LEFT + COLUMN * (seq - 1)

    def x_at(self, at: datetime) -> float:
        """Where an instant falls between the columns of the events around it."""
        index = bisect.bisect_right(self.times, at)
        if index == 0:
            return self.x(1)
        if index == len(self.times):
            return min(self.x(len(self.times)) + COLUMN, self.width - 12)
        before, after = self.times[index - 1], self.times[index]
        share = (at - before) / (after - before) if after > before else 0.0
        return self.x(index) + COLUMN * share

    def ms(self, at: datetime) -> str:
        return f"+{(at - self.start) / timedelta(milliseconds=1):.1f} ms"

    def add(self, markup: str) -> None:
        self.parts.append(markup)

    def mark(
        self,
        kind: str,
        event: Event,
        shape: str,
        *,
        attempt: int | None = None,
        label: str = "",
        note: str = "",
        ended: str | None = None,
    ) -> None:
        """A mark with its tooltip: the event in words (``note`` first), when it happened."""
        scope = f' data-attempt="{attempt}"' if attempt is not None else ""
        scope += f' data-ended="{escape(ended)}"' if ended is not None else ""
        background = isinstance(self.events[0], ev.RequestAccepted) and self.events[0].background
        title = f"seq {event.seq} · {self.ms(event.occurred_at)} · {describe_event(event, background=background)}"
        if note:
            title = f"{note}\n{title}"
        self.add(
            f'<g class="mark" data-mark="{kind}" data-seq="{event.seq}"{scope}>'
            f"<title>{escape(title)}</title>{shape}{label}</g>"
        )


def render_timeline(events: Sequence[Event], result: ReplayResult | None) -> str:
    """The SVG of one request's events (in seq order); ``result`` marks the divergent decisions."""
    if not events:
        raise ValueError("a timeline needs at least one event")
    canvas = _Canvas(events)
    attempts = sorted({event.attempt for event in events if isinstance(event, ev.AttemptScoped)})
    lanes = ["policy", *(f"attempt {number}" for number in attempts), "client"]
    height = TOP + LANE * len(lanes) + 16
    lane_y = {name: TOP + LANE * index + LANE / 2 for index, name in enumerate(lanes)}
    _axis(canvas, height)
    for name in lanes:
        _lane_frame(canvas, name, lane_y[name])
    _policy_lane(canvas, lane_y["policy"], {run.seq: run for run in result.runs} if result else {})
    for number in attempts:
        _attempt_lane(canvas, number, lane_y[f"attempt {number}"])
    _client_lane(canvas, lane_y["client"], TOP, height - 16)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" class="timeline" width="{canvas.width}" height="{height}"'
        f' viewBox="0 0 {canvas.width} {height}" role="img"'
        f' aria-label="timeline of request {escape(events[0].request_id)}">'
        f"{_DEFS}{''.join(canvas.parts)}</svg>"
    )


_DEFS = (
    "<defs>"
    '<pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(45)">'
    f'<rect width="6" height="6" fill="#fff3e0"/><line x1="0" y1="0" x2="0" y2="6" stroke="{COLOURS["fence"]}"'
    ' stroke-width="2"/></pattern>'
    "</defs>"
    "<style>text{font:11px sans-serif;fill:#222}.lane-name{font-weight:bold;font-size:12px}"
    ".small{font-size:10px;fill:#555}.mark:hover{opacity:.7}</style>"
)


def _axis(canvas: _Canvas, height: float) -> None:
    for event in canvas.events:
        x = canvas.x(event.seq)
        canvas.add(f'<line x1="{x}" y1="{TOP - 6}" x2="{x}" y2="{height - 16}" stroke="#eee"/>')
        canvas.add(
            f'<text class="small axis" x="{x}" y="{TOP - 10}" transform="rotate(-35 {x} {TOP - 10})">'
            f"{escape(canvas.ms(event.occurred_at))}</text>"
        )
    canvas.add(f'<text class="small" x="8" y="{TOP - 10}">seq / time since accepted</text>')


def _lane_frame(canvas: _Canvas, name: str, y: float) -> None:
    canvas.add(f'<line x1="{LEFT - 12}" y1="{y + LANE / 2}" x2="{canvas.width}" y2="{y + LANE / 2}" stroke="#ddd"/>')
    canvas.add(f'<text class="lane-name" x="8" y="{y - 8}">{escape(name)}</text>')


def _policy_lane(canvas: _Canvas, y: float, runs: dict[int, DecisionRun]) -> None:
    for index, event in enumerate(e for e in canvas.events if isinstance(e, ev.Decided)):
        run = runs.get(event.seq)
        diverged = run is not None and not run.agrees
        colour = COLOURS["diverged"] if diverged else COLOURS["decision"]
        x = canvas.x(event.seq)
        shape = f'<path d="M{x} {y - 9} L{x + 9} {y} L{x} {y + 9} L{x - 9} {y} Z" fill="{colour}"/>'
        label_y = y + 22 if index % 2 == 0 else y - 14
        label = f'<text class="small" x="{x - 9}" y="{label_y}">{escape(event.action)} ({escape(event.reason)})</text>'
        if diverged and run is not None:
            label += (
                f'<text x="{x - 9}" y="{y + 34}" fill="{COLOURS["diverged"]}" style="fill:{COLOURS["diverged"]}">'
                f"≠ recomputed {escape(summary(run.recomputed))}</text>"
            )
        note = describe_decision(decision_of(event))
        canvas.mark("diverged-decision" if diverged else "decision", event, shape, label=label, note=note)
    canvas.add(f'<text class="small" x="8" y="{y + 8}">recorded decisions</text>')


def _attempt_lane(canvas: _Canvas, number: int, y: float) -> None:
    own = [e for e in canvas.events if isinstance(e, ev.AttemptScoped) and e.attempt == number]
    started = next((e for e in own if isinstance(e, ev.AttemptStarted)), None)
    if started is None:  # pragma: no cover - a legal log starts every attempt it names
        return
    end, how = _attempt_end(canvas.events, number, own)
    x0, x1 = canvas.x(started.seq), canvas.x(end.seq)
    colour = {"completed": COLOURS["completed"], "running": COLOURS["delivered"]}.get(how, COLOURS["failed"])
    if how in ("cancel_acked", "lease_expired", "connection_closed"):
        colour = COLOURS["lease"]
    canvas.add(
        f'<text class="small" x="8" y="{y + 8}">{escape(started.replica_id)} · epoch {started.lease_epoch}</text>'
    )
    canvas.add(f'<text class="small" x="8" y="{y + 22}">ended: {escape(how)}</text>')
    bar = f'<rect x="{x0}" y="{y - 8}" width="{max(x1 - x0, 4)}" height="16" rx="3" fill="{colour}" opacity=".22"/>'
    canvas.mark("attempt", started, bar, attempt=number, ended=how, note=f"attempt {number} ended: {how}")
    lease_x = canvas.x_at(started.lease_expires_at)
    lease = (
        f'<line x1="{x0}" y1="{y + 13}" x2="{lease_x}" y2="{y + 13}" stroke="{COLOURS["lease"]}"'
        f' stroke-dasharray="3 2"/><text class="small" x="{lease_x + 3}" y="{y + 16}">lease as granted</text>'
    )
    note = "the lease as granted at the start; renewals while the stream was read are not logged"
    canvas.mark("lease", started, lease, attempt=number, note=note)
    start_label = f'<text class="small" x="{x0 + 4}" y="{y - 12}">{escape(started.replica_id)}</text>'
    canvas.mark(
        "start", started, f'<rect x="{x0 - 2}" y="{y - 10}" width="4" height="20" fill="#333"/>', attempt=number
    )
    canvas.add(start_label)
    fenced = next((e for e in own if isinstance(e, ev.AttemptFenced)), None)
    if fenced is not None:
        released = next((e for e in own if isinstance(e, ev.AttemptReleased)), None)
        fx1 = canvas.x(released.seq) if released is not None else canvas.width - 12
        span = f'<rect x="{canvas.x(fenced.seq)}" y="{y - 8}" width="{max(fx1 - canvas.x(fenced.seq), 4)}"'
        span += f' height="16" fill="url(#hatch)" stroke="{COLOURS["fence"]}"/>'
        canvas.mark("fence", fenced, span, attempt=number)
    for event in own:
        _attempt_mark(canvas, event, number, y)


def _attempt_end(events: Sequence[Event], number: int, own: Sequence[Event]) -> tuple[Event, str]:
    """The event that ended the attempt and how: released, dead, completed, or still running."""
    for event in own:
        if isinstance(event, ev.AttemptReleased):
            return event, event.because.value
        if isinstance(event, ev.UpstreamFailed) and event.kind in DEAD_KINDS:
            return event, event.kind.value
    successor = next((e for e in events if isinstance(e, ev.AttemptStarted) and e.attempt > number), None)
    if successor is not None:  # pragma: no cover - a legal log releases or loses an attempt before the next
        return successor, "superseded"
    completed = next((e for e in events if isinstance(e, ev.RequestCompleted)), None)
    if completed is not None:
        return completed, "completed"
    ended = any(isinstance(e, ev.RequestFailed | ev.RequestCancelled) for e in events)
    return events[-1], "never released" if ended else "running"


def _attempt_mark(canvas: _Canvas, event: Event, number: int, y: float) -> None:
    x = canvas.x(event.seq)
    if isinstance(event, ev.FirstTokenReceived):
        shape = f'<circle cx="{x}" cy="{y}" r="5" fill="#fff" stroke="#333" stroke-width="2"/>'
        canvas.mark("first-token", event, shape, attempt=number, label=_label(x, y - 12, "first token"))
    elif isinstance(event, ev.DeltasDelivered):
        shape = f'<rect x="{x - 3}" y="{y - 6}" width="6" height="12" fill="{COLOURS["delivered"]}"/>'
        canvas.mark("delivery", event, shape, attempt=number)
    elif isinstance(event, ev.DeltasProduced):  # no client attached: produced, not delivered
        shape = f'<rect x="{x - 3}" y="{y - 6}" width="6" height="12" fill="none" stroke="{COLOURS["delivered"]}"/>'
        canvas.mark("production", event, shape, attempt=number)
    elif isinstance(event, ev.ToolCallEmitted):
        shape = f'<rect x="{x - 5}" y="{y - 5}" width="10" height="10" fill="#6a1b9a"/>'
        canvas.mark("tool-call", event, shape, attempt=number, label=_label(x, y - 12, f"tool {event.name}"))
    elif isinstance(event, ev.UpstreamFailed):
        shape = (
            f'<path d="M{x - 6} {y - 6} L{x + 6} {y + 6} M{x + 6} {y - 6} L{x - 6} {y + 6}"'
            f' stroke="{COLOURS["failed"]}" stroke-width="3"/>'
        )
        canvas.mark("failure", event, shape, attempt=number, label=_label(x, y - 12, event.kind.value, "failed"))
    elif isinstance(event, ev.CancelSent):
        shape = f'<path d="M{x - 4} {y - 6} L{x + 5} {y} L{x - 4} {y + 6} Z" fill="{COLOURS["fence"]}"/>'
        canvas.mark("cancel-sent", event, shape, attempt=number, label=_label(x, y + 28, "cancel sent"))
    elif isinstance(event, ev.CancelAcked):
        shape = f'<circle cx="{x}" cy="{y}" r="5" fill="{COLOURS["fence"]}"/>'
        canvas.mark("cancel-acked", event, shape, attempt=number, label=_label(x, y - 12, "cancel acked"))
    elif isinstance(event, ev.LeaseExpired):
        shape = f'<path d="M{x} {y - 7} L{x + 7} {y} L{x} {y + 7} L{x - 7} {y} Z" fill="{COLOURS["lease"]}"/>'
        canvas.mark("lease-expired", event, shape, attempt=number, label=_label(x, y - 12, "lease expired"))
    elif isinstance(event, ev.AttemptReleased):
        shape = f'<rect x="{x - 2}" y="{y - 10}" width="4" height="20" fill="{COLOURS["fence"]}"/>'
        label = _label(x, y + 28, f"released: {event.because.value}")
        canvas.mark("released", event, shape, attempt=number, label=label)
    elif isinstance(event, ev.AttemptFenced):
        canvas.add(_label(x, y - 12, "fenced", "fence"))


def _client_lane(canvas: _Canvas, y: float, top: float, bottom: float) -> None:
    events = canvas.events
    last = events[-1]
    canvas.add(f'<line x1="{canvas.x(1)}" y1="{y}" x2="{canvas.x(last.seq)}" y2="{y}" stroke="#999" stroke-width="2"/>')
    canvas.mark("accepted", events[0], f'<circle cx="{canvas.x(1)}" cy="{y}" r="4" fill="#333"/>')
    delivered: list[str] = []
    tokens = 0
    for event in events:
        x = canvas.x(event.seq)
        if isinstance(event, ev.FirstDeltaCommitted):
            line = (
                f'<line x1="{x}" y1="{top - 4}" x2="{x}" y2="{bottom}" stroke="{COLOURS["commit"]}"'
                f' stroke-width="2" stroke-dasharray="6 3"/>'
                f'<text x="{x + 4}" y="{top + 10}" style="fill:{COLOURS["commit"]};font-weight:bold">'
                "commit point: no retry after this</text>"
            )
            canvas.mark("commit-point", event, line, attempt=event.attempt)
        elif isinstance(event, ev.DeltasDelivered):
            tokens += event.tokens
            if event.text is not None:
                delivered.append(event.text)
            block = f'<rect x="{x - 5}" y="{y - 9}" width="10" height="18" fill="{COLOURS["delivered"]}"/>'
            label = _label(x, y - 13, f"{event.tokens} tok")
            canvas.mark("client-delivery", event, block, attempt=event.attempt, label=label)
        elif isinstance(event, ev.ClientDisconnected):
            shape = f'<path d="M{x - 6} {y - 6} L{x + 6} {y + 6} M{x + 6} {y - 6} L{x - 6} {y + 6}" stroke="#333"/>'
            if isinstance(events[0], ev.RequestAccepted) and events[0].background:
                gone = "reader left (background: generates on, no grace)"
            else:
                gone = "client disconnected" + (f" (grace {event.resume_grace_s:g}s)" if event.resume_grace_s else "")
            canvas.mark("client-gone", event, shape, label=_label(x, y + 24, gone))
        elif isinstance(event, ev.ClientResumed):
            shape = f'<path d="M{x - 6} {y - 6} L{x + 6} {y} L{x - 6} {y + 6} Z" fill="#333"/>'
            words = f"client attached again after delta {event.after}"
            canvas.mark("client-attached", event, shape, label=_label(x, y + 24, words))
        elif isinstance(event, ev.ResumeGraceExpired):
            shape = f'<circle cx="{x}" cy="{y}" r="5" fill="none" stroke="#333" stroke-width="2"/>'
            canvas.mark("grace-expired", event, shape, label=_label(x, y + 24, "grace expired"))
        elif isinstance(event, ev.StreamResumed):
            shape = f'<path d="M{x - 6} {y} L{x + 6} {y - 6} L{x + 6} {y + 6} Z" fill="#333"/>'
            words = f"resumed: deltas {event.from_index}-{event.to_index}"
            canvas.mark("client-resumed", event, shape, label=_label(x, y + 24, words))
        elif isinstance(event, ev.TERMINAL_EVENTS):
            _terminal(canvas, event, x, y)
    text = "".join(delivered)
    said = f"delivered {plural(tokens, 'token')}" if tokens else "nothing delivered"
    canvas.add(f'<text class="small client-text" x="8" y="{y + 8}">{escape(said)}</text>')
    if tokens:
        kept = preview(text) if delivered else "(text not kept)"
        canvas.add(f'<text class="small client-text" x="8" y="{y + 21}">{escape(kept)}</text>')


def _terminal(canvas: _Canvas, event: Event, x: float, y: float) -> None:
    if isinstance(event, ev.RequestCompleted):
        outcome, words = "completed", f"completed ({event.finish_reason})"
    elif isinstance(event, ev.RequestFailed):
        outcome, words = "failed", f"failed: {event.code}"
    else:
        outcome, words = "cancelled", "cancelled"
    shape = f'<circle cx="{x}" cy="{y}" r="8" fill="{COLOURS[outcome]}"/>'
    canvas.mark(f"request-{outcome}", event, shape, label=_label(x, y + 24, words, outcome))


def _label(x: float, y: float, words: str, colour: str | None = None) -> str:
    style = f' style="fill:{COLOURS[colour]}"' if colour else ""
    return f'<text class="small" x="{x - 6}" y="{y}"{style}>{escape(words)}</text>'
