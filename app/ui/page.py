"""The incident page of one request: summary, verdict, the SVG timeline, the event table.

Server-rendered HTML with inline CSS and no script: it is what ``GET /ui/requests/{id}``
answers, and it prints or saves as a single file.
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape

from app.incident.describe import describe_decision, plural, preview
from app.incident.timeline import TimelineRow, timeline
from app.ui.timeline_svg import render_timeline
from statemachine import events as ev
from statemachine.errors import IllegalTransition
from statemachine.events import Event
from statemachine.replay import ReplayResult, replay

_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222;background:#fafafa}
h1{font-size:20px;margin:0 0 4px}
.facts{display:flex;flex-wrap:wrap;gap:6px 18px;margin:8px 0 12px;padding:0;list-style:none}
.facts b{font-weight:600}
.verdict{padding:8px 12px;border-radius:4px;margin:8px 0 16px;display:inline-block}
.verdict.ok{background:#e8f5e9;border:1px solid #a5d6a7}
.verdict.diverged,.verdict.broken{background:#ffebee;border:1px solid #ef9a9a}
.chart{overflow-x:auto;background:#fff;border:1px solid #ddd;border-radius:4px;padding:8px}
table{border-collapse:collapse;margin-top:16px;background:#fff;font-size:12px}
td,th{border:1px solid #e0e0e0;padding:3px 6px;text-align:left;vertical-align:top}
th{background:#f5f5f5}
td.num{text-align:right}
.legend{font-size:12px;color:#555;margin:6px 0}
"""


def render_page(events: Sequence[Event]) -> str:
    """The whole page of one request, from its events in seq order (replayed here with the
    current policy, so a divergent decision is marked)."""
    request_id = events[0].request_id
    try:
        result: ReplayResult | None = replay(events)
        broken = None
    except IllegalTransition as exc:
        result, broken = None, exc
    rows, _ = timeline(events, result)
    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{escape(request_id)} · phasegate</title>",
        f"<style>{_STYLE}</style></head><body>",
        f"<h1>Request <code>{escape(request_id)}</code></h1>",
        _facts(events, result),
        _verdict(result, broken),
        '<div class="chart">',
        render_timeline(events, result),
        "</div>",
        '<p class="legend">Columns are events in order (time since accepted on top). Hover a mark for the'
        " event. Hatched: an attempt fenced until its release. Dashed under a bar: its lease as granted. Left of the"
        " commit point a failed attempt may be retried on another replica; right of it, never.</p>",
        _table(rows),
        "</body></html>",
    ]
    return "\n".join(parts)


def _facts(events: Sequence[Event], result: ReplayResult | None) -> str:
    accepted = events[0]
    facts: list[tuple[str, str]] = []
    if isinstance(accepted, ev.RequestAccepted):
        facts += [
            ("model", accepted.model),
            ("tenant", accepted.tenant),
            ("prompt tokens", str(accepted.prompt_tokens)),
        ]
        if accepted.trace_id is not None:
            facts.append(("trace", accepted.trace_id))
    facts.append(("accepted", accepted.occurred_at.isoformat(timespec="milliseconds")))
    if result is not None:
        state = result.final_state
        outcome = state.outcome.value if state.outcome else "in flight"
        if state.error_code:
            outcome += f" ({state.error_code})"
        facts += [
            ("outcome", outcome),
            ("attempts", ", ".join(f"{a.attempt}: {a.replica_id}" for a in state.attempts) or "none"),
            ("delivered", plural(state.delivered_output_tokens, "token")),
        ]
    text = "".join(e.text for e in events if isinstance(e, ev.DeltasDelivered) and e.text is not None)
    if text:
        facts.append(("client got", preview(text)))
    items = "".join(f"<li><b>{escape(name)}</b> {escape(value)}</li>" for name, value in facts)
    return f'<ul class="facts">{items}</ul>'


def _verdict(result: ReplayResult | None, broken: IllegalTransition | None) -> str:
    if broken is not None or result is None:
        return f'<div class="verdict broken">The log breaks the state machine: {escape(str(broken))}</div>'
    if result.divergence is None:
        return (
            f'<div class="verdict ok">Replayed with the current policy: no divergence'
            f" ({plural(result.decisions, 'decision')} recomputed the same).</div>"
        )
    divergence = result.divergence
    recorded = "; ".join(describe_decision(d) for d in divergence.recorded)
    recomputed = "; ".join(describe_decision(d) for d in divergence.recomputed) or "no action"
    return (
        f'<div class="verdict diverged">First divergence at seq {divergence.seq}: recorded'
        f" <code>{escape(recorded)}</code>, the current policy decides <code>{escape(recomputed)}</code>.</div>"
    )


def _table(rows: Sequence[TimelineRow]) -> str:
    head = "<tr><th>seq</th><th>time (UTC)</th><th>+ms</th><th>phase</th><th>attempt</th><th>replica</th>"
    head += "<th>event</th><th>decision</th></tr>"
    body = []
    for row in rows:
        cells = (
            (str(row.seq), ""),
            (row.at.strftime("%H:%M:%S.%f")[:-3], ""),
            (f"{row.offset_ms:.1f}", "num"),
            (row.phase, ""),
            (str(row.attempt) if row.attempt is not None else "", ""),
            (row.replica or "", ""),
            (row.event, ""),
            (row.decision, ""),
        )
        body.append("<tr>" + "".join(f'<td class="{cls}">{escape(text)}</td>' for text, cls in cells) + "</tr>")
    return f'<table class="events">{head}{"".join(body)}</table>'
