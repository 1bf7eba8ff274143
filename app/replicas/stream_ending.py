"""The end of an OpenAI-compatible stream as it is read (app/replicas/openai_stream.py): each
choice's tool calls, whose pieces come over many chunks, its finish and stop reasons, and
the usage; the frames that end the attempt's stream once every choice finished."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from app.replicas.base import Done, Frame, ToolCallFrame, UpstreamFailure
from statemachine.events import FINISH_REASONS, FailureKind


class StreamEnding:
    """What a stream says of its end as it goes: each choice's tool calls (pieces, put
    together), its finish and stop reasons, and the usage; the frames that end it."""

    def __init__(self) -> None:
        self.finish_reasons: dict[int, str] = {}
        self.stop_reasons: dict[int, str | int | None] = {}
        self.usage: dict[str, int] | None = None
        self.usage_details: dict[str, Any] | None = None
        self.pending_calls: dict[tuple[int, int], dict[str, str]] = {}

    def note(self, number: int, choice: dict[str, Any], calls: list[dict[str, Any]] | None) -> None:
        """A chunk's choice ``number``: the pieces of its tool calls, and its finish if it says one."""
        for call in calls or ():
            slot = self.pending_calls.setdefault(
                (number, call.get("index", 0)), {"id": "", "name": "", "arguments": ""}
            )
            slot["id"] = slot["id"] or call.get("id") or ""
            function = call.get("function") or {}
            slot["name"] += function.get("name") or ""
            slot["arguments"] += function.get("arguments") or ""
        if choice.get("finish_reason"):
            if choice["finish_reason"] not in FINISH_REASONS:  # the log could not hold it
                raise UpstreamFailure(
                    FailureKind.LIVENESS_UNCERTAIN, f"unknown finish reason {choice['finish_reason']!r}"
                )
            self.finish_reasons[number] = choice["finish_reason"]
            stop = choice.get("stop_reason")
            self.stop_reasons[number] = stop if stop is None or type(stop) in (str, int) else str(stop)

    def frames(self) -> Iterator[Frame]:
        """The tool calls put together, then ``Done``."""
        for (number, call_index), call in sorted(self.pending_calls.items()):
            yield ToolCallFrame(number, call_index, call["id"], call["name"], call["arguments"], streamed=True)
        reasons = [self.finish_reasons[number] for number in sorted(self.finish_reasons)]
        stops = [self.stop_reasons.get(number) for number in sorted(self.finish_reasons)]
        usage, details = self.usage or {}, self.usage_details
        yield Done(reasons[0], reasons, usage, stops if any(s is not None for s in stops) else [], details)
