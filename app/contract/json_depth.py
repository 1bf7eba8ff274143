"""How deep a request's JSON may nest, one limit for every route and replica kind, and an
encoder that writes whatever that limit admits.

``vllm serve`` answers bodies nested a little under a thousand levels (its JSON reader's
recursion decides; docs/compatibility.md has the figure), so the gateway refuses only what
is deeper than :data:`MAX_JSON_DEPTH`, where the body is parsed, with a 400 naming the limit;
the worker takes the same bodies with the few levels its start body wraps them in
(:data:`WORKER_MAX_JSON_DEPTH`). Every encoder on the path must then write such a body:
orjson stops at 255 levels and the standard library's C encoder at Python's recursion
limit, less the frames already on the stack, so :func:`dumps` falls back, for a body too
deep for them, to an iterative encoder whose output is byte for byte the standard
library's (a digest of the same body is the same digest at any depth).

Depth counts containers: ``{}`` is 1, ``{"a": []}`` is 2, a scalar is 0.
"""

from __future__ import annotations

import json
from typing import Any

# vLLM's answered depth rounded up (docs/compatibility.md), under orjson's reader's 1,024
MAX_JSON_DEPTH = 1000
WORKER_MAX_JSON_DEPTH = MAX_JSON_DEPTH + 8  # the start body's own levels around the client's values


def depth_over(value: Any, limit: int) -> bool:
    """Whether ``value`` nests deeper than ``limit`` containers (walked without recursion)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return False


def dumps(
    value: Any,
    *,
    sort_keys: bool = False,
    separators: tuple[str, str] = (",", ":"),
    ensure_ascii: bool = False,
    allow_nan: bool = True,
) -> str:
    """``json.dumps(value, …)`` at any depth: the standard library's, or where it runs out of
    stack, the same text written iteratively."""
    try:
        return json.dumps(
            value, sort_keys=sort_keys, separators=separators, ensure_ascii=ensure_ascii, allow_nan=allow_nan
        )
    except RecursionError:
        return _dumps_iteratively(value, sort_keys, separators, ensure_ascii, allow_nan)


class _Text(str):
    """Text already written (a bracket, a key and its colon): emitted as it is."""

    __slots__ = ()


def _dumps_iteratively(
    value: Any, sort_keys: bool, separators: tuple[str, str], ensure_ascii: bool, allow_nan: bool
) -> str:
    item_separator, key_separator = separators

    def scalar(item: Any) -> str:
        return json.dumps(item, ensure_ascii=ensure_ascii, allow_nan=allow_nan)

    parts: list[str] = []
    work: list[Any] = [value]  # a stack: what is popped next is written next
    while work:
        item = work.pop()
        if isinstance(item, _Text):
            parts.append(item)
        elif isinstance(item, dict):
            keys = sorted(item) if sort_keys else list(item)
            work.append(_Text("}"))
            for place in reversed(range(len(keys))):
                key = keys[place]
                work.append(item[key])
                work.append(_Text((item_separator if place else "") + scalar(_key(key)) + key_separator))
            parts.append("{")
        elif isinstance(item, list | tuple):
            work.append(_Text("]"))
            for place in reversed(range(len(item))):
                work.append(item[place])
                if place:
                    work.append(_Text(item_separator))
            parts.append("[")
        else:
            parts.append(scalar(item))
    return "".join(parts)


def _key(key: Any) -> str:
    """A key as the standard library writes it (JSON's keys are strings; these are its rules)."""
    if isinstance(key, str):
        return key
    if key is True or key is False or key is None:
        return json.dumps(key)
    if isinstance(key, int | float):
        return json.dumps(key) if isinstance(key, float) else str(key)
    raise TypeError(f"keys must be str, int, float, bool or None, not {type(key).__name__}")
