"""``evolve(value, changes)``: ``dataclasses.replace`` for the fold's frozen values.

Why not replace() itself: the fold builds a new state for every event, and replace()
re-checks the class, then ``__init__`` sets every field through the frozen
``object.__setattr__``, one call per field: a large part of replaying an event
(ops/bench/replay.py; figures: docs/performance.md). The fold's values therefore keep
their fields in an instance ``__dict__`` (they are frozen dataclasses without
``slots``), and a copy with changes is one dictionary merge, done in C.

It serves classes without ``__post_init__`` or init-only fields, so nothing but
replace()'s checks is skipped; an unknown field still raises.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

_T = TypeVar("_T")

_FIELDS: dict[type, frozenset[str]] = {}
_new = object.__new__
_set = object.__setattr__  # past the frozen class's own __setattr__, as __init__ does


def evolve(value: _T, changes: Mapping[str, Any]) -> _T:
    """A copy of the frozen, dict-backed dataclass ``value`` with ``changes`` applied."""
    cls = type(value)
    names = _FIELDS.get(cls) or _learn(cls)
    if not changes.keys() <= names:
        raise TypeError(f"{cls.__name__} has no field {', '.join(sorted(changes.keys() - names))}")
    new = _new(cls)
    _set(new, "__dict__", {**value.__dict__, **changes})
    return new


def _learn(cls: type) -> frozenset[str]:
    if "__slots__" in cls.__dict__:
        raise TypeError(f"evolve() copies an instance __dict__; {cls.__name__} is slotted")
    names = frozenset(f.name for f in dataclasses.fields(cls))
    _FIELDS[cls] = names
    return names
