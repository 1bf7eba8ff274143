"""A JSON answer that echoes what the client sent, written at any depth the body reader admits.

A response object carries the request's own fields back (a Responses API ``tools`` with its
schemas, ``text.format``), so it nests as deep as the body did: Starlette's ``JSONResponse``
writes with the standard library, which stops short of the limit
(app/contract/json_depth.py); this one writes the same bytes at any depth.
"""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from app.contract import json_depth as deep_json


class JSONAnswer(JSONResponse):
    """``JSONResponse``, its body written by :func:`app.contract.json_depth.dumps`."""

    def render(self, content: Any) -> bytes:
        return deep_json.dumps(content, allow_nan=False).encode()
