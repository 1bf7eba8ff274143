"""Render the transition table as a Mermaid state diagram for the docs.

``ops/render_phases.py`` writes the result to ``docs/phases.md``; a test renders it
again and fails when the file is stale, so the picture cannot drift from the code.
"""

from __future__ import annotations

from collections import defaultdict

from statemachine.phases import TRANSITIONS, Phase

HEADER = """# Request phases

Generated from `statemachine/phases.py` by `python ops/render_phases.py`; do not edit.
A test fails when this file and the transition table disagree.
"""


def render_phases_markdown() -> str:
    """The whole of ``docs/phases.md``: the diagram and the table it is drawn from."""
    edges: dict[tuple[Phase, Phase], list[str]] = defaultdict(list)
    for phase, row in TRANSITIONS.items():
        for event_type, target in row.items():
            edges[(phase, target)].append(event_type.__name__)
    lines = [HEADER, "```mermaid", "stateDiagram-v2"]
    for (source, target), names in edges.items():
        start = "[*]" if source is Phase.NEW else source.value
        lines.append(f"    {start} --> {target.value}: {', '.join(names)}")
    lines.append(f"    {Phase.TERMINATED.value} --> [*]")
    lines += ["```", "", "| phase | event | next phase |", "|---|---|---|"]
    for phase, row in TRANSITIONS.items():
        for event_type, target in row.items():
            lines.append(f"| {phase.value} | {event_type.__name__} | {target.value} |")
    lines += [
        "",
        "Any pair not listed raises `IllegalTransition(phase, event, request_id)`.",
        "`terminated` absorbs: only the old attempt's fence bookkeeping may follow it.",
        "",
    ]
    return "\n".join(lines)
