"""Traces: requests' events as JSON lines, for replay away from the database.

A trace is text: a header line, then one event per line in the JSON form of
:mod:`statemachine.events`::

    {"format": "phasegate-trace", "version": 1, "requests": ["req_a", "req_b"], ...}
    {"type": "RequestAccepted", "v": 1, "request_id": "req_a", "seq": 1, ...}
    ...

Each listed request's events appear in seq order starting at 1 (requests may
interleave). Parsing takes lines, not files, so it stays free of I/O; every error
names the line it found.

Writing is deterministic, so that a trace exported from the log, imported elsewhere
and exported again is the same text byte for byte. PostgreSQL's jsonb keeps no key
order inside a body, so nested objects are written in one canonical order:
``Decided.params`` in the order of the action's fields, ``usage`` in OpenAI's order,
anything else sorted, at every depth (a start's pool snapshot, a request's
routing). A redacted trace (``redact=True``) drops what the client was sent, the
delivered text and tool call arguments, and says so in its header.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from statemachine.actions import ACTION_TYPES, action_params_order
from statemachine.errors import IllegalTransition, MalformedEvent, TraceError
from statemachine.events import Decided, DeltasDelivered, DeltasProduced, Event, RequestCompleted, ToolCallEmitted
from statemachine.jsonform import from_json, to_json
from statemachine.request_state import RequestState
from statemachine.state import apply

TRACE_FORMAT = "phasegate-trace"
TRACE_VERSION = 1


@dataclass(frozen=True, slots=True)
class Trace:
    header: dict[str, Any]
    requests: dict[str, list[Event]] = field(default_factory=dict)
    lines: dict[str, list[int]] = field(default_factory=dict)  # request id -> the line of each event, by seq

    def line_of(self, request_id: str, seq: int) -> int:
        """The line number of the request's event ``seq`` (0 if the trace was not parsed)."""
        numbers = self.lines.get(request_id, [])
        return numbers[seq - 1] if 0 < seq <= len(numbers) else 0

    @property
    def events(self) -> list[Event]:
        return [event for events in self.requests.values() for event in events]


def parse_trace(lines: Iterable[str]) -> Trace:
    """Parse a trace's lines, or raise :class:`TraceError` naming the first bad line."""
    numbered = enumerate(lines, start=1)
    header: dict[str, Any] | None = None
    for number, line in numbered:
        if line.strip():
            header = _parse_header(number, line)
            break
    if header is None:
        raise TraceError(0, "the trace is empty")
    requests: dict[str, list[Event]] = {request_id: [] for request_id in header["requests"]}
    where: dict[str, list[int]] = {request_id: [] for request_id in header["requests"]}
    for number, line in numbered:
        text = line.strip()
        if not text:
            continue
        try:
            event = from_json(_json_value(number, text))
        except MalformedEvent as exc:
            raise TraceError(number, str(exc)) from None
        events = requests.get(event.request_id)
        if events is None:
            raise TraceError(number, f"request {event.request_id} is not listed in the header")
        if event.seq != len(events) + 1:
            raise TraceError(number, f"seq {event.seq} of request {event.request_id} does not follow seq {len(events)}")
        events.append(event)
        where[event.request_id].append(number)
    empty = [request_id for request_id, events in requests.items() if not events]
    if empty:
        raise TraceError(0, f"no events for listed request(s) {', '.join(empty)}")
    return Trace(header, requests, where)


# json.loads() minus its Python wrapping, which costs more than the C scanner it calls on
# short lines: replaying a trace is mostly decoding it (ops/bench/replay.py).
_scan_json: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


def _json_value(number: int, text: str) -> Any:
    try:
        value, end = _scan_json(text, 0)
    except StopIteration:
        raise TraceError(number, "not valid JSON (Expecting value)") from None
    except json.JSONDecodeError as exc:
        raise TraceError(number, f"not valid JSON ({exc.msg}); is the line truncated?") from None
    if end != len(text):
        raise TraceError(number, "not valid JSON (Extra data after the event)")
    return value


def fold_trace(trace: Trace) -> dict[str, RequestState]:
    """Every request's state at the end of the trace; an event the state machine refuses
    is a :class:`TraceError` naming its line (a trace to import must be legal)."""
    states: dict[str, RequestState] = {}
    for request_id, events in trace.requests.items():
        state = RequestState(request_id=request_id)
        for event in events:
            try:
                state = apply(state, event)
            except IllegalTransition as exc:
                raise TraceError(trace.line_of(request_id, event.seq), str(exc)) from None
        states[request_id] = state
    return states


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


def dump_trace(
    events: Iterable[Event], meta: Mapping[str, Any] | None = None, *, redact: bool = False
) -> Iterator[str]:
    """The lines of a trace holding ``events`` (in the order given), header first."""
    events = list(events)
    request_ids = list(dict.fromkeys(event.request_id for event in events))
    yield trace_header(request_ids, meta, redact=redact)
    for event in events:
        yield trace_line(event, redact=redact)


def trace_header(request_ids: Iterable[str], meta: Mapping[str, Any] | None = None, *, redact: bool = False) -> str:
    """The header line of a trace of ``request_ids``, with ``meta`` fields after the format's own."""
    header = {"format": TRACE_FORMAT, "version": TRACE_VERSION, "requests": list(request_ids), **(meta or {})}
    if redact:
        header["redacted"] = list(REDACTED_FIELDS)
    return json.dumps(header, ensure_ascii=False) + "\n"


def trace_line(event: Event, *, redact: bool = False) -> str:
    """One event's line, its nested objects in canonical order (see the module docstring)."""
    form = to_json(event)
    body = form["body"]
    for name, value in body.items():
        if isinstance(value, dict):
            body[name] = _sorted(value)
    if isinstance(event, Decided):
        action = ACTION_TYPES.get(event.action)
        body["params"] = _ordered(body["params"], action_params_order(action) if action else ())
    elif isinstance(event, RequestCompleted):
        body["usage"] = _ordered(event.usage, _USAGE_ORDER)
    if redact:
        for name in _REDACTED.get(type(event), ()):
            if name in body:  # (a field added later is absent from an event written before it)
                body[name] = _REDACTED_VALUE[name]
    return json.dumps(form, ensure_ascii=False) + "\n"


# What a redacted trace drops: everything the client was sent.
_DELTA_CONTENT = ("text", "logprobs", "token_ids", "prompts", "prompt_logprobs")
REDACTED_FIELDS = (
    *(f"{cls}.{name}" for cls in ("DeltasDelivered", "DeltasProduced") for name in _DELTA_CONTENT),
    "ToolCallEmitted.arguments",
)
_REDACTED = {DeltasDelivered: _DELTA_CONTENT, DeltasProduced: _DELTA_CONTENT, ToolCallEmitted: ("arguments",)}
_REDACTED_VALUE: dict[str, Any] = {
    "text": None,
    "logprobs": None,
    "token_ids": [],
    "prompts": [],
    "prompt_logprobs": [],
    "arguments": "",
}
_USAGE_ORDER = ("prompt_tokens", "completion_tokens", "total_tokens")


def _sorted(value: Any) -> Any:
    """``value`` with the keys of every object in it sorted."""
    if isinstance(value, dict):
        return {name: _sorted(value[name]) for name in sorted(value)}
    if isinstance(value, list):
        return [_sorted(item) for item in value]
    return value


def _ordered(values: Mapping[str, Any], order: Iterable[str]) -> dict[str, Any]:
    first = [name for name in order if name in values]
    return {name: values[name] for name in [*first, *sorted(set(values) - set(first))]}
