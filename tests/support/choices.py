"""What a client of an ``n > 1`` request received, choice by choice, over raw SSE.

:class:`~ops.transcript.Transcript` keeps every content delta in one list; a request
for several choices also needs them apart, to say that each choice the client got is
whole (or a prefix of what the replica would have said). :func:`stream_choices` reads
one streamed chat to its end and keeps both views.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx

from ops.transcript import Transcript


@dataclass
class ChoiceTranscript:
    """A :class:`Transcript` plus the content deltas and finish reason of each choice."""

    transcript: Transcript
    deltas: dict[int, list[str]] = field(default_factory=dict)
    finish_reasons: dict[int, str] = field(default_factory=dict)

    @property
    def texts(self) -> dict[int, str]:
        return {choice: "".join(parts) for choice, parts in sorted(self.deltas.items())}

    def read(self, line: str) -> None:
        self.transcript.read(line)
        if not line.startswith("data: ") or line == "data: [DONE]":
            return
        payload: dict[str, Any] = json.loads(line[6:])
        for choice in payload.get("choices", []):
            content = (choice.get("delta") or {}).get("content")
            if content:
                self.deltas.setdefault(choice["index"], []).append(content)
            if choice.get("finish_reason"):
                self.finish_reasons[choice["index"]] = choice["finish_reason"]


def stream_choices(base_url: str, body: dict[str, Any], *, timeout: float = 60.0) -> ChoiceTranscript:
    """POST a streamed chat and read it to the end, keeping each choice's deltas apart."""
    with (
        httpx.Client(base_url=base_url, timeout=timeout) as http,
        http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response,
    ):
        received = ChoiceTranscript(Transcript(response.headers.get("x-request-id", ""), response.status_code))
        if response.status_code != 200:
            received.transcript.error = json.loads(response.read())["error"]
            return received
        for line in response.iter_lines():
            received.read(line)
    return received
