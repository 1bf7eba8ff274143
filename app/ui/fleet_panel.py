"""The fleet on the list of requests: each replica's state, and the latest fleet events
(docs/design.md §16). Shown to the admin token only: a tenant's key lists its own
requests, not the operator's fleet."""

from __future__ import annotations

from html import escape
from typing import Any

from app.store.fleet import FleetStore
from app.store.postgres import PostgresEventStore

RECENT_EVENTS = 10


async def fleet_panel(store: object) -> str:
    """An HTML fragment: every replica and the latest events (none without PostgreSQL)."""
    if not isinstance(store, PostgresEventStore):
        return ""
    fleet = FleetStore(store)
    members, live, events = await fleet.members(), await fleet.live_attempts(), await fleet.events(limit=RECENT_EVENTS)
    rows = []
    for member in members:
        models = ", ".join(f"{name}={revision}" if revision else name for name, revision in member.models) or "every"
        leaving = " (leaving)" if member.leaving else ""
        rows.append(
            f'<tr class="replica {escape(member.state)}" data-replica="{escape(member.replica_id)}">'
            f"<td>{escape(member.replica_id)}</td><td>{escape(member.state)}{leaving}</td>"
            f"<td>{escape(member.source)}</td><td>{escape(member.kind)}</td><td>{escape(models)}</td>"
            f"<td>{live.get(member.replica_id, 0)}</td>"
            f"<td>{escape(member.since.isoformat(timespec='seconds'))}</td></tr>"
        )
    changes = [
        f'<li class="fleet-event">{escape(str(e["at"])[:19])} {escape(e["event"])} {escape(e["replica_id"])}'
        f" ({escape(e['source'])}, {escape(e['actor'])}{_reason(e)})</li>"
        for e in events
    ]
    return "\n".join(
        [
            '<section class="fleet"><h2>Fleet</h2>',
            "<table><tr><th>replica</th><th>state</th><th>source</th><th>kind</th><th>models</th>"
            "<th>live</th><th>since</th></tr>",
            *(rows or ['<tr><td colspan="7">no replica: requests get no_replica_available</td></tr>']),
            "</table>",
            "<ul>",
            *changes,
            "</ul></section>",
        ]
    )


def _reason(event: dict[str, Any]) -> str:
    return f": {escape(event['reason'])}" if event.get("reason") else ""
