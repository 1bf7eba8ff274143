"""What a streaming client received, exactly: the SSE lines of one chat completion.

Shared by the chaos run (``ops/chaos.py``) and the fault tests (``tests/support/``),
which read the stream with different HTTP clients but judge the same record: every
event's ``id:``, the text deltas in order (content, and reasoning where the replica
splits it out: each is a delta the log counts), tool-call deltas, the final error event
if any, and whether ``[DONE]`` arrived.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from app.api.shape import ChoiceAnswer
from statemachine.deltas import TOOL_CALLS


@dataclass
class Transcript:
    request_id: str
    status: int
    event_ids: list[int] = field(default_factory=list)
    contents: list[str] = field(default_factory=list)  # every delta's text: content, reasoning, or none
    kinds: list[str] = field(default_factory=list)  # the field each of them came in
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # the pieces, as they came
    error: dict[str, Any] | None = None
    done: bool = False
    finish_reason: str | None = None
    cut: bool = False  # the connection broke mid-stream (its gateway died under it)

    @property
    def text(self) -> str:
        """Every text delivered, reasoning included, in order (as the log joins it)."""
        return "".join(self.contents)

    @property
    def content(self) -> str:
        """The answer's content alone."""
        return "".join(t for t, kind in zip(self.contents, self.kinds, strict=True) if kind == "content")

    @property
    def calls(self) -> list[dict[str, Any]]:
        """The tool calls, their pieces joined by ``index`` as a whole answer joins them."""
        answer = ChoiceAnswer()
        if self.tool_calls:
            answer.add(TOOL_CALLS, json.dumps(self.tool_calls), None)
        return answer.tool_calls

    def read(self, line: str) -> bool:
        """Take one SSE line; ``True`` when it added a text delta."""
        if line.startswith("id: "):
            self.event_ids.append(int(line[4:]))
        elif line == "data: [DONE]":
            self.done = True
        elif line.startswith("data: "):
            payload = json.loads(line[6:])
            if "error" in payload:
                self.error = payload["error"]
                return False
            before = len(self.contents)
            for choice in payload.get("choices", []):
                delta = choice.get("delta", {})
                texts = [kind for kind in ("reasoning", "reasoning_content", "content") if delta.get(kind)]
                if not texts and not delta and (choice.get("logprobs") or {}).get("content"):
                    texts = [""]  # a token with no text, its log probabilities only (vLLM's think-block end)
                for kind in texts:  # a chunk's reasoning comes first
                    self.contents.append(delta.get(kind, ""))
                    self.kinds.append(kind)
                self.tool_calls.extend(delta.get("tool_calls") or [])
                self.finish_reason = choice.get("finish_reason") or self.finish_reason
            return len(self.contents) > before
        return False
