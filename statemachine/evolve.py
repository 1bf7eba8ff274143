"""``evolve(value, changes)``: ``dataclasses.replace`` for the fold's frozen, slotted values.

Why not replace() itself: the fold builds a new state for every event, and replace()
costs about twice this (it re-checks the class, then ``__init__`` sets every field
through the frozen ``object.__setattr__``); here each slot is copied by its own
descriptor. It serves classes without ``__post_init__`` or init-only fields, so
nothing but replace()'s checks is skipped; an unknown field still raises.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Mapping
from typing import Any, TypeVar

_T = TypeVar("_T")

# Per class: its field names, a getter of all its fields at once, each slot's setter in
# field order, and each field's setter by name.
_Layout = tuple[frozenset[str], Any, tuple[Any, ...], dict[str, Any]]
_SLOTS: dict[type, _Layout] = {}
_new = object.__new__


def evolve(value: _T, changes: Mapping[str, Any]) -> _T:
    """A copy of the frozen, slotted dataclass ``value`` with ``changes`` applied."""
    cls = type(value)
    names, get_all, puts, setters = _SLOTS.get(cls) or _learn(cls)
    if not changes.keys() <= names:
        raise TypeError(f"{cls.__name__} has no field {', '.join(sorted(changes.keys() - names))}")
    new = _new(cls)
    for put, field_value in zip(puts, get_all(value), strict=True):  # copy every slot,
        put(new, field_value)
    for name, changed in changes.items():  # then overwrite the few that change
        setters[name](new, changed)
    return new


def _learn(cls: type) -> _Layout:
    names = [f.name for f in dataclasses.fields(cls)]
    descriptors = [getattr(cls, name) for name in names]
    get_all = operator.attrgetter(*names) if len(names) > 1 else (lambda value: (getattr(value, names[0]),))
    layout = (
        frozenset(names),
        get_all,
        tuple(d.__set__ for d in descriptors),
        {name: d.__set__ for name, d in zip(names, descriptors, strict=True)},
    )
    _SLOTS[cls] = layout
    return layout
