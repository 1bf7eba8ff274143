"""The Responses API's output items (docs/design.md §15): a ``message`` or ``reasoning`` item
as it grows from the deltas of its key, its part and its body, the ids' prefixes, and a
token's log probabilities in this API's form (app/api/responses/shape.py builds the answer
from them)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from app.contract.logprobs import TokenLogprob
from statemachine.deltas import CONTENT, REASONING_FIELDS

MESSAGE = "message"
REASONING = "reasoning"
ID_PREFIX = {MESSAGE: "msg", REASONING: "rs", "function_call": "fc"}  # an item id's, by its kind


def item_kind(key: str) -> str | None:
    if key == CONTENT:
        return MESSAGE
    return REASONING if key in REASONING_FIELDS else None  # no text (a logprobs-only token): no item


def logprobs_of(entries: Sequence[TokenLogprob], *, with_bytes: bool) -> list[dict[str, Any]]:
    def one(token: str, logprob: float | None) -> dict[str, Any]:
        entry: dict[str, Any] = {"token": token, "logprob": logprob}
        if with_bytes:
            entry["bytes"] = list(token.encode("utf-8", "replace"))
        return entry

    # a token named otherwise (token_id:<id>): its bytes are the name's, as vLLM's Responses API gives them
    return [{**one(entry[0], entry[1]), "top_logprobs": [one(t, lp) for t, lp in entry[2]]} for entry in entries]


class Item:
    """An output item as it grows."""

    def __init__(self, kind: str, item_id: str) -> None:
        self.kind = kind
        self.id = item_id
        self.pieces: list[str] = []
        self.logprobs: list[TokenLogprob] = []

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def part(self, *, logprobs: bool) -> dict[str, Any]:
        if self.kind == REASONING:
            return {"type": "reasoning_text", "text": self.text}
        rendered = logprobs_of(self.logprobs, with_bytes=True) if logprobs else []
        return {"type": "output_text", "text": self.text, "annotations": [], "logprobs": rendered}

    def body(self, status: str, *, logprobs: bool) -> dict[str, Any]:
        content = [self.part(logprobs=logprobs)] if self.pieces or status == "completed" else []
        if self.kind == REASONING:
            return {"id": self.id, "type": "reasoning", "summary": [], "content": content, "status": status}
        return {"id": self.id, "type": "message", "role": "assistant", "status": status, "content": content}
