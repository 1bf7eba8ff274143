"""A streamed Anthropic message read as raw SSE, for the fault tests of ``/v1/messages``."""

from __future__ import annotations

import json
from typing import Any

import httpx

from tests.support.gateway import MODEL


def read_message_stream(url: str, content: str, frames: list[tuple[str, dict[str, Any]]], ids: list[str]) -> None:
    """Stream a message of up to 2,000 tokens from the gateway at ``url``: its request id
    into ``ids`` once the head arrives, each event as ``(event, data)`` into ``frames`` as it
    arrives (so a test can act while it runs)."""
    body = {"model": MODEL, "max_tokens": 2000, "stream": True, "messages": [{"role": "user", "content": content}]}
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{url}/v1/messages", json=body) as answer:
        ids.append(answer.headers["x-request-id"])
        kind = ""
        for line in answer.iter_lines():
            if line.startswith("event: "):
                kind = line.removeprefix("event: ")
            elif line.startswith("data: "):
                frames.append((kind, json.loads(line.removeprefix("data: "))))
