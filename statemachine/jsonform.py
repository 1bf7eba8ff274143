"""Events in JSON, the form the log stores (columns for the envelope, jsonb for the
body) and traces carry one per line::

    {"type": "AttemptStarted", "v": 1, "request_id": "req_…", "seq": 2,
     "occurred_at": "2026-11-30T17:00:00.000001+00:00",
     "attempt": 1, "lease_epoch": 1,
     "body": {"replica_id": "w1", "lease_expires_at": "2026-11-30T17:00:05+00:00"}}

``to_json`` and ``from_json`` round-trip losslessly; ``from_json`` rejects an unknown
type, a missing or extra field and a value of the wrong type with a
:class:`MalformedEvent` that names the field.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from datetime import datetime
from typing import Any

from statemachine.deltas import DeltaLogprobs
from statemachine.errors import MalformedEvent, UnknownEventType
from statemachine.events import EVENT_TYPES, Event, is_attempt_scoped
from statemachine.field_parsers import parser_for, plain_types

_ENVELOPE = ("request_id", "seq", "occurred_at")
_ATTEMPT_SCOPE = ("attempt", "lease_epoch")


def written_as(event: Event) -> tuple[int, tuple[str, ...]]:
    """The schema version ``event`` is written at and its body's fields in it: the oldest
    that holds it (a field a later version added, at its default, is not written; a value
    in the wider form a later version allows is written at that version)."""
    forms = _FORMS[type(event)]
    version = 1
    for added_in, names in forms.added:
        if any(getattr(event, name) != default for name, default in names):
            version = added_in
    for widened_in, fields in forms.widened:
        if widened_in > version and any(_WIDER[name](getattr(event, name)) for name in fields):
            version = widened_in
    return version, forms.body_fields[version]


def _names_a_token(logprobs: DeltaLogprobs | None) -> bool:
    """Whether some token of ``logprobs`` was sent under another name than its text."""
    return logprobs is not None and any(len(entry) == 4 for delta in logprobs for entry in delta)


# what says that a field's value needs the wider form a later version allows (``WIDENED``)
_WIDER: dict[str, typing.Callable[[Any], bool]] = {"logprobs": _names_a_token}


def to_json(event: Event) -> dict[str, Any]:
    """The event as plain JSON values (the log's row and the trace's line)."""
    cls = type(event)
    version, body_fields = written_as(event)
    out: dict[str, Any] = {
        "type": cls.__name__,
        "v": version,
        "request_id": event.request_id,
        "seq": event.seq,
        "occurred_at": event.occurred_at.isoformat(),
    }
    if is_attempt_scoped(cls):
        out["attempt"] = event.attempt  # type: ignore[union-attr]
        out["lease_epoch"] = event.lease_epoch  # type: ignore[union-attr]
    out["body"] = {name: _dump(getattr(event, name)) for name in body_fields}
    return out


def _dump(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, tuple):
        return [_dump(item) for item in value]
    if isinstance(value, dict):
        return dict(value)
    if isinstance(value, enum.Enum):
        return value.value
    return value  # str, int, bool and None are JSON as they are


def from_json(data: Any) -> Event:
    """Rebuild an event from its JSON form, rejecting anything malformed."""
    if not isinstance(data, dict):
        raise MalformedEvent(f"an event must be a JSON object, not {type(data).__name__}")
    type_name = data.get("type")
    cls = EVENT_TYPES.get(type_name) if isinstance(type_name, str) else None
    if cls is None or not isinstance(type_name, str):
        raise UnknownEventType(f"unknown event type {type_name!r}")
    version = data.get("v")
    spec = _SPECS[cls].get(version) if type(version) is int else None
    if spec is None:
        raise MalformedEvent(f"{type_name}: unsupported schema version {version!r}")
    if data.keys() != spec.keys:
        raise MalformedEvent(_key_mismatch(type_name, "envelope", set(data), set(spec.keys)))
    body = data["body"]
    if not isinstance(body, dict):
        raise MalformedEvent(f"{type_name}: body must be a JSON object")
    if not spec.required_body <= body.keys() <= spec.body_fields:
        raise MalformedEvent(_key_mismatch(type_name, "body", set(body), set(spec.body_fields)))
    # The hot path of replaying a trace: a value of a plain JSON type (str, int, bool,
    # None where allowed) is taken as it is; anything else goes through its parser,
    # which converts it (timestamps, enums, lists) or raises the message.
    # The event is built slot by slot (each slot's own descriptor), as __init__ would
    # set it without the frozen __setattr__'s detour: events have no __post_init__.
    event = _new(cls)
    fields = spec.fields
    name = ""
    try:
        for name in spec.envelope:
            value = data[name]
            plain, parser, put = fields[name]
            put(event, value if type(value) in plain else parser(value))
        for name, value in body.items():
            plain, parser, put = fields[name]
            put(event, value if type(value) in plain else parser(value))
    except (TypeError, ValueError) as exc:
        raise MalformedEvent(f"{type_name}.{name}: {exc}") from None
    for name, default in spec.defaults:
        if name not in body:
            fields[name][2](event, default)
    return event


def _key_mismatch(type_name: str, where: str, got: set[str], expected: set[str]) -> str:
    missing = sorted(expected - got)
    extra = sorted(got - expected)
    parts = []
    if missing:
        parts.append(f"missing {', '.join(missing)}")
    if extra:
        parts.append(f"unexpected {', '.join(extra)}")
    return f"{type_name}: {where} has {'; '.join(parts)}"


class _Spec(typing.NamedTuple):
    keys: frozenset[str]  # the envelope's keys
    envelope: tuple[str, ...]  # the envelope's fields
    body_fields: frozenset[str]
    required_body: frozenset[str]
    # name -> (plain types, parser, the slot's setter)
    fields: dict[str, tuple[frozenset[type], typing.Callable[[Any], Any], typing.Callable[[Any, Any], None]]]
    defaults: tuple[tuple[str, Any], ...]  # optional body fields and their defaults


class _Forms(typing.NamedTuple):
    """An event type's schema versions: the fields each later one added, with their
    defaults, and its body's fields at each version."""

    added: tuple[tuple[int, tuple[tuple[str, Any], ...]], ...]
    widened: tuple[tuple[int, tuple[str, ...]], ...]
    body_fields: dict[int, tuple[str, ...]]


_new = object.__new__
_FORMS: dict[type[Event], _Forms] = {}
_SPECS: dict[type[Event], dict[int, _Spec]] = {}
for _cls in EVENT_TYPES.values():
    _hints = typing.get_type_hints(_cls)
    _fields = dataclasses.fields(_cls)
    _defaults = {field.name: field.default for field in _fields}
    _envelope = _ENVELOPE + _ATTEMPT_SCOPE if is_attempt_scoped(_cls) else _ENVELOPE
    _body = tuple(field.name for field in _fields if field.name not in _ENVELOPE + _ATTEMPT_SCOPE)
    _added_in = {name: version for version, names in _cls.ADDED.items() for name in names}
    _FORMS[_cls] = _Forms(
        added=tuple(
            (version, tuple((name, _defaults[name]) for name in names)) for version, names in sorted(_cls.ADDED.items())
        ),
        widened=tuple(sorted(_cls.WIDENED.items())),
        body_fields={
            version: tuple(name for name in _body if _added_in.get(name, 1) <= version)
            for version in range(1, _cls.SCHEMA_VERSION + 1)
        },
    )
    _parsers = {
        field.name: (
            plain_types(_hints[field.name]),
            parser_for(_hints[field.name]),
            getattr(_cls, field.name).__set__,
        )
        for field in _fields
    }
    _SPECS[_cls] = {
        version: _Spec(
            keys=frozenset({"type", "v", "body", *_envelope}),
            envelope=_envelope,
            body_fields=frozenset(names),
            required_body=frozenset(name for name in names if _defaults[name] is dataclasses.MISSING),
            fields=_parsers,
            defaults=tuple(
                (field.name, field.default) for field in _fields if field.default is not dataclasses.MISSING
            ),
        )
        for version, names in _FORMS[_cls].body_fields.items()
    }
