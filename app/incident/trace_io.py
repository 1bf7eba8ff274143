"""Traces in and out of the log: ``phasegate trace export`` and ``phasegate trace import``.

Export reads the selected requests' events in the order the log recorded them (its
positions) and writes them as a trace (:mod:`statemachine.trace`): a header line,
then one event per line, canonical, so exporting what was imported gives the same
bytes back.

Import is all or nothing, in one PostgreSQL transaction:

1. the whole file is parsed and every request folded first, so a malformed line or
   an event the state machine refuses is reported with its line before the database
   is touched;
2. inside the transaction, a request id already in the log refuses the trace (a
   trace is a record; it is never merged into another request's stream);
3. every event is inserted by the store's own statement, so the read models'
   trigger projects them as it projects the gateway's appends; if PostgreSQL skips
   or refuses a row (another writer raced us), the transaction rolls back.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any, TextIO

import asyncpg
from sqlalchemy.ext.asyncio import AsyncConnection

from app.store.codec import to_row
from app.store.database import asyncpg_dsn
from app.store.errors import InvalidAppend
from app.store.insert import INSERT_EVENTS_LOOKUP, columns
from app.store.partitions import ensure_days
from app.store.queries import known_requests, stream_in_log_order
from statemachine.errors import TraceError
from statemachine.trace import Trace, fold_trace, parse_trace, trace_header, trace_line


class TraceRefused(Exception):
    """A trace that cannot be read or imported; the message names the file and the line."""


@dataclass(frozen=True, slots=True)
class Imported:
    requests: int
    events: int


def read_trace(path: str) -> Trace:
    """Parse the trace at ``path`` (``-``: standard input), or :class:`TraceRefused` naming its line."""
    name = "<stdin>" if path == "-" else path
    try:
        if path == "-":
            lines = list(sys.stdin)
        else:
            with Path(path).open(encoding="utf-8") as file:
                lines = list(file)
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceRefused(f"{name}: cannot read it: {exc}") from None
    check_lines(lines, name)
    try:
        return parse_trace(lines)
    except TraceError as exc:
        if exc.line == 0 and str(exc).startswith("no events for listed"):
            header = next(number for number, line in enumerate(lines, start=1) if line.strip())
            raise TraceRefused(f"{name}: line {header}: {exc}") from None
        raise TraceRefused(f"{name}: {exc}") from None


# --- what the parser would crash on, or the log rewrite --------------------------------------

MAX_DEPTH = 64
INT64 = range(-(2**63), 2**63)
# Cheap signs that a line needs the full check: a NUL or surrogate escape, a long run of
# digits, deep nesting. Most lines show none, and are decoded only once (by parse_trace).
_SUSPECT = re.compile(r"\\u0000|\\u[dD][89a-fA-F]|\d{19,}")  # surrogates: D800-DFFF, high and low


def check_lines(lines: Sequence[str], name: str) -> None:
    """Refuse, naming its line, what ``parse_trace`` would crash on (nesting past its
    recursion, integers past 4,300 digits) and what the log cannot hold as it is (NUL,
    which PostgreSQL text refuses; lone surrogates; integers past 64 bits; a header
    version that is a boolean): a trace is a record, and is never rewritten on import."""
    header_seen = False
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        problem = None
        if not header_seen:
            header_seen = True
            problem = _header_problem(line)
        if problem is None and (_SUSPECT.search(line) or line.count("[") + line.count("{") > MAX_DEPTH):
            problem = _line_problem(line)
        if problem is not None:
            raise TraceRefused(f"{name}: line {number}: {problem}")


def _header_problem(line: str) -> str | None:
    try:
        header = json.loads(line)
    except (ValueError, RecursionError):
        return None  # parse_trace names it
    if isinstance(header, dict) and isinstance(header.get("version"), bool):
        return f"the trace version must be an integer, not {json.dumps(header['version'])}"
    return None


def _line_problem(line: str) -> str | None:
    try:
        value = json.loads(line)
    except RecursionError:
        return f"nested deeper than {MAX_DEPTH} levels"
    except ValueError as exc:
        if "integer string conversion" in str(exc):
            return "an integer of thousands of digits"
        return None  # parse_trace names it
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth >= MAX_DEPTH:
                return f"nested deeper than {MAX_DEPTH} levels"
            children = [*item.keys(), *item.values()] if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
        elif isinstance(item, str):
            if "\x00" in item:
                return f"a NUL character in {_shown(item)} (the log cannot hold it, and a trace is never rewritten)"
            if not item.isascii():
                try:
                    item.encode()
                except UnicodeEncodeError:
                    return f"a lone UTF-16 surrogate in {_shown(item)}"
        elif isinstance(item, int) and not isinstance(item, bool) and item not in INT64:
            return "an integer outside 64 bits"
    return None


def _shown(text: str) -> str:
    return ascii(text if len(text) <= 40 else text[:40] + "…")


async def export_trace(
    connection: AsyncConnection,
    request_ids: Sequence[str],
    out: TextIO,
    *,
    redact: bool = False,
    meta: dict[str, Any] | None = None,
) -> int:
    """Write the requests' trace to ``out``; returns the number of events written.

    The header lists the requests in the order ``request_ids`` gives them; requests
    with no events are left out. Events are written as they are read.
    """
    present = await known_requests(connection, request_ids)
    out.write(trace_header([r for r in dict.fromkeys(request_ids) if r in present], meta, redact=redact))
    written = 0
    async for event in stream_in_log_order(connection, request_ids):
        out.write(trace_line(event, redact=redact))
        written += 1
    return written


async def import_trace(url: str, trace: Trace, *, name: str) -> Imported:
    """Load ``trace`` into the log at ``url``, all of it or nothing (see the module docstring)."""
    try:
        fold_trace(trace)
    except TraceError as exc:
        raise TraceRefused(f"{name}: {exc}") from None
    events = sorted(trace.events, key=lambda event: trace.line_of(event.request_id, event.seq))
    rows = []
    days: dict[str, date | None] = {}  # each request's accept day, from its RequestAccepted (seq 1)
    for event in events:
        try:
            row = to_row(event, days.get(event.request_id))
            if row.type == "RequestAccepted":
                days[event.request_id] = row.accepted_on
            rows.append(row)
        except InvalidAppend as exc:  # replayable, but not something the log can hold
            line = trace.line_of(event.request_id, event.seq)
            raise TraceRefused(f"{name}: line {line}: {exc}; nothing was imported") from None
    connection = await asyncpg.connect(asyncpg_dsn(url))
    try:
        if await connection.fetchval("SELECT to_regclass('request_events')") is None:
            raise TraceRefused("the database has no phasegate schema: run 'phasegate db upgrade' first")
        async with connection.transaction():
            existing = await connection.fetch(
                "SELECT DISTINCT request_id FROM request_events WHERE request_id = ANY($1::text[])",
                list(trace.requests),
            )
            if existing:
                duplicate = min((row["request_id"] for row in existing), key=lambda r: trace.line_of(r, 1))
                raise TraceRefused(
                    f"{name}: line {trace.line_of(duplicate, 1)}: request {duplicate} is already in the database;"
                    " nothing was imported"
                )
            await ensure_days(connection, [day for day in days.values() if day is not None])
            try:
                status = await connection.execute(INSERT_EVENTS_LOOKUP, *columns(rows))
            except asyncpg.PostgresError as exc:
                raise TraceRefused(f"{name}: PostgreSQL refused the events ({exc}); nothing was imported") from None
            if int(status.split()[-1]) != len(rows):
                raise TraceRefused(f"{name}: another writer recorded some of these events; nothing was imported")
    finally:
        await connection.close()
    return Imported(len(trace.requests), len(rows))
