"""Scripted faults, for tests that drive a gateway and need a replica to misbehave on cue.

A fault is an action at a point of one attempt's token loop, plus a matcher that picks
the attempts it applies to. Faults are registered at startup (``--fault JSON``) or at
run time (``POST /admin/faults``), both only when the worker runs with
``--enable-faults``. Each start request takes at most one fault: the first registered
one whose matcher accepts it and that has uses left. See docs/worker-protocol.md.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from app.worker.protocol import AttemptSpec, Code, Refusal


class FaultAction(enum.StrEnum):
    """What a scripted fault does to the attempt it matched."""

    DIE = "die"  # the process dies: SIGKILL, its whole group when it leads one
    STALL = "stall"  # publish nothing from token k on; still honour cancel and lease expiry
    HOLD = "hold"  # publish nothing from token k on until released (POST /admin/faults/{id}/release)
    REJECT = "reject"  # refuse the start with an HTTP status (429 or 503)
    MALFORMED_FRAME = "malformed_frame"  # a broken line before token k, then go on
    CLOSE_WITHOUT_DONE = "close_without_done"  # end the stream cleanly after k tokens, no done
    TOOL_CALL_THEN_DIE = "tool_call_then_die"  # after k tokens: a tool_call frame, then die
    SLOW_PREFILL = "slow_prefill"  # hold the attempt in prefill (with heartbeats) for prefill_ms
    ENGINE_ERROR = "engine_error"  # the engine fails on the request in prefill: an engine_error frame


class Point(enum.StrEnum):
    """Where a ``die`` happens."""

    PREFILL = "prefill"  # admitted and heartbeating, before the engine produced a token
    BEFORE_FRAME = "before_frame"  # token k computed by the engine, its frame not written
    AFTER_FRAME = "after_frame"  # token k's frame written (and given 20 ms to leave)


_ACTIONS_WITH_TOKEN = {
    FaultAction.DIE,
    FaultAction.STALL,
    FaultAction.HOLD,
    FaultAction.MALFORMED_FRAME,
    FaultAction.CLOSE_WITHOUT_DONE,
}
_DEFAULT_REJECT_CODE = {429: Code.QUEUE_FULL, 503: Code.REPLICA_EXITING}


@dataclass(slots=True)
class Fault:
    """One scripted fault and what it applies to."""

    id: int
    action: FaultAction
    at_token: int = 0
    point: Point = Point.BEFORE_FRAME
    status: int = 503
    code: Code = Code.REPLICA_EXITING
    retry_after: int | None = None
    prefill_ms: int = 0
    tool_name: str = "lookup"
    tool_arguments: str = "{}"
    prompt_contains: str | None = None
    request_id: str | None = None
    attempt: int | None = None
    remaining: int | None = 1  # None: every matching attempt
    spec: dict[str, Any] = field(default_factory=dict)  # as registered, for GET /admin/faults
    released: asyncio.Event = field(default_factory=asyncio.Event)  # a hold goes on once set

    def matches(self, attempt: AttemptSpec) -> bool:
        if self.remaining is not None and self.remaining <= 0:
            return False
        if self.request_id is not None and attempt.request_id != self.request_id:
            return False
        if self.attempt is not None and attempt.attempt != self.attempt:
            return False
        return self.prompt_contains is None or self.prompt_contains in attempt.prompt_text()

    def describe(self) -> dict[str, Any]:
        described = {"id": self.id, "remaining": self.remaining, **self.spec}
        if self.action is FaultAction.HOLD:
            described["released"] = self.released.is_set()
        return described

    def reject(self) -> Refusal:
        message = f"injected fault {self.id}: rejected with {self.status}"
        return Refusal(self.status, self.code, message, retry_after=self.retry_after)


class FaultBook:
    """The faults this worker will inject, in registration order."""

    def __init__(self) -> None:
        self._faults: list[Fault] = []
        self._ids = itertools.count(1)

    def add(self, raw: Mapping[str, Any]) -> Fault:
        fault = parse_fault(raw, next(self._ids))
        self._faults.append(fault)
        return fault

    def take(self, attempt: AttemptSpec) -> Fault | None:
        """The fault for this attempt, if any; uses it up once."""
        for fault in self._faults:
            if fault.matches(attempt):
                if fault.remaining is not None:
                    fault.remaining -= 1
                return fault
        return None

    def release(self, fault_id: int, hold_at: int | None = None) -> Fault:
        """Let the attempt a ``hold`` fault holds go on: for good, or (``hold_at``) until
        that token, where it holds again for the next release."""
        for fault in self._faults:
            if fault.id == fault_id and fault.action is FaultAction.HOLD:
                holding = fault.released
                if hold_at is not None:
                    fault.at_token, fault.released = hold_at, asyncio.Event()
                holding.set()
                return fault
        raise Refusal(404, Code.NOT_FOUND, f"no hold fault with id {fault_id}")

    def clear(self) -> int:
        count = len(self._faults)
        self._faults.clear()
        return count

    def describe(self) -> list[dict[str, Any]]:
        return [fault.describe() for fault in self._faults]


def _bad(field_name: str, why: str) -> Refusal:
    return Refusal(400, Code.INVALID_FIELD, f"{field_name}: {why}", field=field_name)


def _opt_int(raw: Mapping[str, Any], key: str, low: int, high: int) -> int | None:
    value = raw.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise _bad(key, f"must be an integer between {low} and {high}")
    return value


_FAULT_FIELDS = {
    "action",
    "at_token",
    "point",
    "status",
    "code",
    "retry_after",
    "prefill_ms",
    "tool_name",
    "tool_arguments",
    "match",
    "times",
}


def parse_fault(raw: Mapping[str, Any], fault_id: int) -> Fault:
    """A fault from its JSON form; raises :class:`Refusal` (400) naming the bad field."""
    if not isinstance(raw, Mapping):
        raise _bad("fault", "must be an object")
    unknown = sorted(set(raw) - _FAULT_FIELDS)
    if unknown:
        raise Refusal(400, Code.UNKNOWN_FIELD, f"unknown fault field {unknown[0]!r}", field=unknown[0])
    try:
        action = FaultAction(str(raw.get("action")))
    except ValueError:
        raise _bad("action", f"must be one of {', '.join(a.value for a in FaultAction)}") from None
    fault = Fault(id=fault_id, action=action, spec=dict(raw))
    fault.at_token = _opt_int(raw, "at_token", 0, 1_000_000) or 0
    if "point" in raw:
        if action is not FaultAction.DIE:
            raise _bad("point", "only a die fault has a point")
        try:
            fault.point = Point(raw["point"])
        except ValueError:
            raise _bad("point", "must be prefill, before_frame or after_frame") from None
    if action is FaultAction.REJECT:
        fault.status = _opt_int(raw, "status", 400, 599) or 503
        try:
            fault.code = Code(raw["code"]) if "code" in raw else _DEFAULT_REJECT_CODE.get(fault.status, Code.NOT_READY)
        except ValueError:
            raise _bad("code", "must be one of the protocol's error codes") from None
        fault.retry_after = _opt_int(raw, "retry_after", 0, 3600)
    if action is FaultAction.SLOW_PREFILL:
        fault.prefill_ms = _opt_int(raw, "prefill_ms", 1, 600_000) or 1000
    if action is FaultAction.TOOL_CALL_THEN_DIE:
        fault.tool_name = str(raw.get("tool_name", fault.tool_name))
        fault.tool_arguments = str(raw.get("tool_arguments", fault.tool_arguments))
    elif "at_token" in raw and action not in _ACTIONS_WITH_TOKEN:
        raise _bad("at_token", f"a {action} fault has no token position")
    # times: how many matching attempts it applies to (default 1); null: all of them
    unlimited = "times" in raw and raw["times"] is None
    fault.remaining = None if unlimited else (_opt_int(raw, "times", 1, 1_000_000) or 1)
    match = raw.get("match") or {}
    if not isinstance(match, Mapping) or set(match) - {"prompt_contains", "request_id", "attempt"}:
        raise _bad("match", "may hold prompt_contains, request_id and attempt")
    fault.prompt_contains = match.get("prompt_contains")
    fault.request_id = match.get("request_id")
    fault.attempt = _opt_int(match, "attempt", 1, 1_000_000)
    return fault
