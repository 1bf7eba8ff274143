"""Every error the state machine raises, in one tree.

    StateMachineError
    ├── IllegalTransition        an event the request's current phase does not allow,
    │                            or one that breaks an invariant of the request
    │                            (a second live attempt, a splice of two attempts' output)
    ├── MalformedEvent           a JSON form that is not a valid event (ValueError)
    │   └── UnknownEventType     its "type" names no event of the vocabulary
    └── TraceError               a trace file that cannot be read, naming its line (ValueError)

These are programming errors of the caller (the driver, a replayed trace), never
conditions to ignore: the state machine raises at once, as h11 raises
``LocalProtocolError``.
"""

from __future__ import annotations


class StateMachineError(Exception):
    """Base of every error raised by :mod:`statemachine`."""


class IllegalTransition(StateMachineError):
    """An event that is not legal for the request in its current phase."""

    def __init__(self, phase: str, event_type: str, request_id: str, why: str | None = None) -> None:
        self.phase = phase
        self.event_type = event_type
        self.request_id = request_id
        self.why = why
        message = f"can't handle event {event_type} in phase {phase} (request {request_id})"
        if why:
            message += f": {why}"
        super().__init__(message)


class MalformedEvent(StateMachineError, ValueError):
    """A serialised event that cannot be turned back into an event."""


class UnknownEventType(MalformedEvent):
    """A serialised event whose type is not part of the vocabulary."""


class TraceError(StateMachineError, ValueError):
    """A trace that cannot be read; ``line`` is 1-based (0 when it is the whole trace)."""

    def __init__(self, line: int, message: str) -> None:
        self.line = line
        super().__init__(f"line {line}: {message}" if line else message)
