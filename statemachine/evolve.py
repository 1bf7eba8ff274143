"""``evolve(value, changes)``: ``dataclasses.replace`` for the fold's frozen, slotted values.

Why not replace() itself: the fold builds a new state for every event, and replace()
costs about twice this (it re-checks the class, then ``__init__`` sets every field
through the frozen ``object.__setattr__``); here each slot is copied by its own
descriptor. It serves classes without ``__post_init__`` or init-only fields, so
nothing but replace()'s checks is skipped; an unknown field still raises.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

_T = TypeVar("_T")

# Per class: its field names, and each slot's (name, get, set) descriptor functions.
_SLOTS: dict[type, tuple[frozenset[str], tuple[tuple[str, Any, Any], ...]]] = {}


def evolve(value: _T, changes: Mapping[str, Any]) -> _T:
    """A copy of the frozen, slotted dataclass ``value`` with ``changes`` applied."""
    cls = type(value)
    layout = _SLOTS.get(cls) or _learn(cls)
    names, slots = layout
    if not changes.keys() <= names:
        raise TypeError(f"{cls.__name__} has no field {', '.join(sorted(changes.keys() - names))}")
    new = object.__new__(cls)
    for name, get, put in slots:
        put(new, changes[name] if name in changes else get(value))
    return new


def _learn(cls: type) -> tuple[frozenset[str], tuple[tuple[str, Any, Any], ...]]:
    fields = dataclasses.fields(cls)
    layout = (
        frozenset(f.name for f in fields),
        tuple((f.name, getattr(cls, f.name).__get__, getattr(cls, f.name).__set__) for f in fields),
    )
    _SLOTS[cls] = layout
    return layout
