"""The events' envelopes (docs/design.md §3): the fields every event carries, and those every
event about one attempt carries, with the schema versions of an event's body. Abstract: no
concrete event (:mod:`statemachine.events`) inherits from another."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import ClassVar


@dataclass(frozen=True, slots=True)
class RequestScoped:
    """Fields every event carries.

    ``SCHEMA_VERSION`` is the event's newest form; ``ADDED`` names the body fields each later
    version added (all with defaults), ``WIDENED`` those whose values it may write in a wider form.
    An event is written in the oldest form that holds it: while its added fields keep their defaults
    (and its values the narrower form) it is written as before, so an earlier release's logs read the
    same and it can still read it (:func:`statemachine.jsonform.written_as`); every older form decodes."""

    SCHEMA_VERSION: ClassVar[int] = 1
    ADDED: ClassVar[dict[int, tuple[str, ...]]] = {}
    WIDENED: ClassVar[dict[int, tuple[str, ...]]] = {}
    request_id: str
    seq: int
    occurred_at: datetime


@dataclass(frozen=True, slots=True)
class AttemptScoped(RequestScoped):
    """Fields every event about one attempt carries."""

    attempt: int
    lease_epoch: int
