"""A request's header lines and JSON body as bytes, and an answer's ``Retry-After`` as
seconds: the fields an upstream's request and answer carry, encoded and read the same
way on both transports (:mod:`app.replicas.upstream_http` and httpx)."""

from __future__ import annotations

from typing import Any

import orjson

from app.contract import json_depth as deep_json


def header_line(name: str, value: str) -> bytes:
    """One header field as :meth:`Connections.post` takes it."""
    line = f"{name}: {value}\r\n".encode()
    if line.count(b"\n") != 1 or line.count(b"\r") != 1:  # a field must never end the head early
        raise ValueError(f"a line break in the header {name}")
    return line


def json_body(value: Any) -> bytes:
    """A request's JSON body, by orjson (httpx's ``json=`` took three times as long)."""
    try:
        return orjson.dumps(value)
    except TypeError:  # what orjson cannot write (an integer over 64 bits, over 254 levels deep)
        return deep_json.dumps(value, allow_nan=False).encode()


def retry_after_seconds(value: str | None) -> float | None:
    """An answer's ``Retry-After`` in seconds (the delay form; none, or not a number: ``None``)."""
    try:
        return max(float(value), 0.0) if value else None
    except ValueError:
        return None
