"""Traces: requests' events as JSON lines, for replay away from the database.

A trace is text: a header line, then one event per line in the JSON form of
:mod:`statemachine.events`::

    {"format": "phasegate-trace", "version": 1, "requests": ["req_a", "req_b"], ...}
    {"type": "RequestAccepted", "v": 1, "request_id": "req_a", "seq": 1, ...}
    ...

Each listed request's events appear in seq order starting at 1 (requests may
interleave). Parsing takes lines, not files, so it stays free of I/O; every error
names the line it found.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from statemachine.errors import MalformedEvent, TraceError
from statemachine.events import Event, from_json, to_json

TRACE_FORMAT = "phasegate-trace"
TRACE_VERSION = 1


@dataclass(frozen=True, slots=True)
class Trace:
    header: dict[str, Any]
    requests: dict[str, list[Event]] = field(default_factory=dict)

    @property
    def events(self) -> list[Event]:
        return [event for events in self.requests.values() for event in events]


def parse_trace(lines: Iterable[str]) -> Trace:
    """Parse a trace's lines, or raise :class:`TraceError` naming the first bad line."""
    numbered = ((number, line) for number, line in enumerate(lines, start=1) if line.strip())
    first = next(numbered, None)
    if first is None:
        raise TraceError(0, "the trace is empty")
    header = _parse_header(*first)
    requests: dict[str, list[Event]] = {request_id: [] for request_id in header["requests"]}
    for number, line in numbered:
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(number, f"not valid JSON ({exc.msg}); is the line truncated?") from None
        try:
            event = from_json(data)
        except MalformedEvent as exc:
            raise TraceError(number, str(exc)) from None
        events = requests.get(event.request_id)
        if events is None:
            raise TraceError(number, f"request {event.request_id} is not listed in the header")
        if event.seq != len(events) + 1:
            raise TraceError(number, f"seq {event.seq} of request {event.request_id} does not follow seq {len(events)}")
        events.append(event)
    empty = [request_id for request_id, events in requests.items() if not events]
    if empty:
        raise TraceError(0, f"no events for listed request(s) {', '.join(empty)}")
    return Trace(header, requests)


def _parse_header(number: int, line: str) -> dict[str, Any]:
    try:
        header = json.loads(line)
    except json.JSONDecodeError:
        header = None
    if not isinstance(header, dict) or header.get("format") != TRACE_FORMAT:
        raise TraceError(number, f'the first line must be the trace header {{"format": "{TRACE_FORMAT}", …}}')
    if header.get("version") != TRACE_VERSION:
        raise TraceError(number, f"unsupported trace version {header.get('version')!r}")
    listed = header.get("requests")
    if not isinstance(listed, list) or not all(isinstance(r, str) for r in listed) or not listed:
        raise TraceError(number, "the header must list the trace's request ids")
    if len(set(listed)) != len(listed):
        raise TraceError(number, "the header lists a request twice")
    return header


def dump_trace(events: Iterable[Event], meta: Mapping[str, Any] | None = None) -> Iterator[str]:
    """The lines of a trace holding ``events`` (in the order given), header first."""
    events = list(events)
    request_ids = list(dict.fromkeys(event.request_id for event in events))
    header = {"format": TRACE_FORMAT, "version": TRACE_VERSION, "requests": request_ids, **(meta or {})}
    yield json.dumps(header, ensure_ascii=False) + "\n"
    for event in events:
        yield json.dumps(to_json(event), ensure_ascii=False) + "\n"
