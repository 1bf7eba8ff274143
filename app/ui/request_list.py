"""The list of recent requests (``GET /ui/requests``): filters, a keyset-paged query, the page.

How this works: the filters come from the query string (:meth:`RequestFilter.parse`
refuses what it cannot use, naming the parameter). :func:`recent_requests` reads the
``requests`` read model newest first, ordered by ``(accepted_at, request_id)``, and a
page ends with a cursor, the last row's pair, so the next page starts strictly after it
(``WHERE (accepted_at, request_id) < cursor``): no offset to count past, and rows
accepted meanwhile do not shift the pages already seen. :func:`render_requests_page`
draws the rows as an HTML table whose ids link to each request's timeline page.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from datetime import datetime
from html import escape
from typing import Any
from urllib.parse import quote, urlencode

from sqlalchemy import exists, literal_column, select, tuple_
from sqlalchemy.ext.asyncio import AsyncConnection

from app.contract.integers import IntegerRefused, parse_integer
from app.store import schema
from app.store.queries import OUTCOMES

MIGRATIONS = ("any", "none", "prefill_retry", "new_request")  # none: one attempt; any: more than one
DEFAULT_LIMIT = 50
MAX_LIMIT = 500
MAX_FILTER_CHARS = 256


class BadFilter(ValueError):
    """A query parameter that cannot be used; ``param`` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class RequestFilter:
    """Which requests the page lists; every field is optional."""

    outcome: str | None = None  # one of OUTCOMES
    model: str | None = None
    tenant: str | None = None
    error_code: str | None = None
    migration: str | None = None  # one of MIGRATIONS
    since: datetime | None = None  # accepted at or after
    until: datetime | None = None  # accepted before
    limit: int = DEFAULT_LIMIT
    before: tuple[datetime, str] | None = None  # the cursor: the previous page's last row

    @classmethod
    def parse(cls, query: Mapping[str, str]) -> RequestFilter:
        values: dict[str, Any] = {}
        for name in ("model", "tenant", "error_code"):
            if query.get(name):
                values[name] = _text(name, query[name])
        for name, allowed in (("outcome", OUTCOMES), ("migration", MIGRATIONS)):
            if query.get(name):
                if query[name] not in allowed:
                    raise BadFilter(name, f"{name} must be one of {', '.join(allowed)}")
                values[name] = query[name]
        for name in ("since", "until"):
            if query.get(name):
                values[name] = _instant(name, query[name])
        if query.get("limit"):
            try:
                values["limit"] = parse_integer(query["limit"], "limit", minimum=1, maximum=MAX_LIMIT)
            except IntegerRefused as exc:
                raise BadFilter("limit", str(exc)) from None
        if query.get("before"):
            values["before"] = decode_cursor(query["before"])
        return cls(**values)

    def query_string(self, **changes: Any) -> str:
        """This filter as a query string (with ``changes``), for links to other pages."""
        pairs: list[tuple[str, str]] = []
        for f in fields(self):
            value = changes.get(f.name, getattr(self, f.name))
            if value is None or (f.name == "limit" and value == DEFAULT_LIMIT):
                continue
            if f.name == "before":
                value = encode_cursor(value)
            elif isinstance(value, datetime):
                value = value.isoformat()
            pairs.append((f.name, str(value)))
        return urlencode(pairs)


def encode_cursor(cursor: tuple[datetime, str]) -> str:
    accepted_at, request_id = cursor
    return base64.urlsafe_b64encode(f"{accepted_at.isoformat()}|{request_id}".encode()).decode().rstrip("=")


def decode_cursor(text: str) -> tuple[datetime, str]:
    try:
        decoded = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)).decode()
        at, _, request_id = decoded.partition("|")
        instant = datetime.fromisoformat(at)
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise BadFilter("before", "before is not a cursor this page gave out") from None
    if not request_id or instant.tzinfo is None:
        raise BadFilter("before", "before is not a cursor this page gave out")
    return instant, request_id


@dataclass(frozen=True, slots=True)
class RequestPage:
    rows: list[dict[str, Any]]
    next_cursor: tuple[datetime, str] | None  # None: this was the last page


async def recent_requests(connection: AsyncConnection, wanted: RequestFilter) -> RequestPage:
    """One page of the ``requests`` read model, newest first."""
    r = schema.requests.c
    columns: tuple[Any, ...] = (
        r.request_id,
        r.accepted_at,
        r.model,
        r.tenant,
        r.gateway,
        r.outcome,
        r.phase,
        r.error_code,
        r.attempts,
        r.replicas_tried,
        r.delivered_output_tokens,
        # in the read model (migration 0001), not in the narrower Table the writer uses
        literal_column("requests.ttft_ms").label("ttft_ms"),
        literal_column("requests.duration_ms").label("duration_ms"),
    )
    query = (
        select(*columns)
        .select_from(schema.requests)
        .order_by(r.accepted_at.desc(), r.request_id.desc())
        .limit(wanted.limit + 1)
    )
    conditions: list[Any] = []
    if wanted.outcome == "unfinished":
        conditions.append(r.outcome.is_(None))
    elif wanted.outcome is not None:
        conditions.append(r.outcome == wanted.outcome)
    for name in ("model", "tenant", "error_code"):
        if getattr(wanted, name) is not None:
            conditions.append(r[name] == getattr(wanted, name))
    if wanted.migration == "any":
        conditions.append(r.attempts > 1)
    elif wanted.migration == "none":
        conditions.append(r.attempts <= 1)
    elif wanted.migration is not None:  # a retry of that kind was decided (docs/design.md §5)
        e = schema.request_events.c
        conditions.append(
            exists().where(
                e.request_id == r.request_id,
                e.type == "Decided",
                e.body["params"]["migration"].astext == wanted.migration,
            )
        )
    if wanted.since is not None:
        conditions.append(r.accepted_at >= wanted.since)
    if wanted.until is not None:
        conditions.append(r.accepted_at < wanted.until)
    if wanted.before is not None:
        at, request_id = wanted.before
        conditions.append(tuple_(r.accepted_at, r.request_id) < tuple_(at, request_id))
    if conditions:
        query = query.where(*conditions)
    rows = [dict(row) for row in (await connection.execute(query)).mappings()]
    more = len(rows) > wanted.limit
    rows = rows[: wanted.limit]
    return RequestPage(rows, (rows[-1]["accepted_at"], rows[-1]["request_id"]) if more else None)


_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222;background:#fafafa}
h1{font-size:20px;margin:0 0 12px}
form{display:flex;flex-wrap:wrap;gap:6px 12px;align-items:end;margin-bottom:12px}
label{display:flex;flex-direction:column;font-size:12px;color:#555}
table{border-collapse:collapse;background:#fff;font-size:12px}
td,th{border:1px solid #e0e0e0;padding:3px 6px;text-align:left;vertical-align:top}
th{background:#f5f5f5}
td.num{text-align:right}
.failed{color:#b71c1c}.cancelled{color:#8d6e63}.unfinished{color:#1565c0}
.pages{margin:12px 0}
"""

_OUTCOME_CHOICES = ("", *OUTCOMES)
_MIGRATION_CHOICES = ("", *MIGRATIONS)


def render_requests_page(
    page: RequestPage, wanted: RequestFilter, *, base: str = "/ui/requests", fleet: str = ""
) -> str:
    """The whole list page: the filter form, the rows (each id links to its timeline), the next
    page; ``fleet``: the fleet's panel (app/ui/fleet_panel.py), for the admin token."""
    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        "<title>Requests · phasegate</title>",
        f"<style>{_STYLE}</style></head><body>",
        "<h1>Recent requests</h1>",
        _form(wanted, base),
        _table(page.rows, base),
        '<p class="pages">',
    ]
    if wanted.before is not None:
        parts.append(f'<a class="first" href="{escape(base)}?{escape(wanted.query_string(before=None))}">newest</a> ')
    if page.next_cursor is not None:
        parts.append(
            f'<a class="next" href="{escape(base)}?{escape(wanted.query_string(before=page.next_cursor))}">older</a>'
        )
    elif page.rows:
        parts.append("no older requests")
    parts += ["</p>", fleet, "</body></html>"]
    return "\n".join(parts)


def _form(wanted: RequestFilter, base: str) -> str:
    def text_input(name: str, label: str) -> str:
        value = getattr(wanted, name)
        shown = value.isoformat() if isinstance(value, datetime) else value or ""
        return f'<label>{label}<input name="{name}" value="{escape(shown)}"></label>'

    def choice(name: str, choices: Sequence[str]) -> str:
        options = "".join(
            f'<option value="{c}"{" selected" if getattr(wanted, name) == c else ""}>{c or "all"}</option>'
            for c in choices
        )
        return f'<label>{name}<select name="{name}">{options}</select></label>'

    return (
        f'<form method="get" action="{escape(base)}">'
        + choice("outcome", _OUTCOME_CHOICES)
        + text_input("model", "model")
        + text_input("tenant", "tenant")
        + text_input("error_code", "error code")
        + choice("migration", _MIGRATION_CHOICES)
        + text_input("since", "accepted since (ISO 8601)")
        + text_input("until", "until")
        + '<button type="submit">filter</button></form>'
    )


def _table(rows: Sequence[dict[str, Any]], base: str) -> str:
    if not rows:
        return '<p class="empty">No request matches.</p>'
    head = "".join(
        f"<th>{name}</th>"
        for name in (
            "accepted (UTC)",
            "request",
            "model",
            "tenant",
            "outcome",
            "attempts",
            "replicas",
            "delivered tokens",
            "TTFT ms",
            "duration ms",
            "gateway",
        )
    )
    body = [f'<table class="requests"><tr>{head}</tr>']
    for row in rows:
        outcome = row["outcome"] or "unfinished"
        if row["error_code"]:
            outcome += f" ({row['error_code']})"
        link = f"{base}/{quote(row['request_id'], safe='')}"
        cells = [
            (row["accepted_at"].strftime("%Y-%m-%d %H:%M:%S.%f")[:-3], ""),
            (f'<a href="{escape(link)}">{escape(row["request_id"])}</a>', "id"),
            (escape(row["model"] or ""), ""),
            (escape(row["tenant"] or ""), ""),
            (escape(outcome), f"outcome {escape(row['outcome'] or 'unfinished')}"),
            (str(row["attempts"]), "num"),
            (escape(", ".join(row["replicas_tried"] or ())), ""),
            (str(row["delivered_output_tokens"]), "num"),
            (_ms(row["ttft_ms"]), "num"),
            (_ms(row["duration_ms"]), "num"),
            (escape(row["gateway"] or ""), ""),
        ]
        body.append(
            f'<tr data-request="{escape(row["request_id"])}">'
            + "".join(f'<td class="{cls}">{html}</td>' for html, cls in cells)
            + "</tr>"
        )
    body.append("</table>")
    return "".join(body)


def _ms(value: float | None) -> str:
    return "" if value is None else f"{value:.1f}"


def _text(name: str, value: str) -> str:
    if len(value) > MAX_FILTER_CHARS or not value.isprintable():
        raise BadFilter(name, f"{name} must be printable text of at most {MAX_FILTER_CHARS} characters")
    return value


def _instant(name: str, value: str) -> datetime:
    try:
        instant = datetime.fromisoformat(value)
    except ValueError:
        raise BadFilter(name, f"{name} must be an ISO 8601 time, e.g. 2026-01-31T12:00:00Z") from None
    if instant.tzinfo is None:
        raise BadFilter(name, f"{name} must name its time zone (Z or +00:00)")
    return instant
