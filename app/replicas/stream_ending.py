"""The end of an OpenAI-compatible stream as it is read (app/replicas/openai_stream.py): each
choice's tool calls, whose pieces come over many chunks, its finish and stop reasons, and
the usage; the frames that end the attempt's stream once every choice finished. And the
usage so far an upstream sends in each chunk where asked (``continuous_usage_stats``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, TypeGuard

from app.replicas.base import Done, Frame, ToolCallFrame, UpstreamFailure, usage_of
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

    def frames(self, last_said: dict[str, Any] | None = None) -> Iterator[Frame]:
        """The tool calls put together, then ``Done``: with the answer's usage, else the last
        usage so far a chunk said (``last_said``: where the answer's never came)."""
        for (number, call_index), call in sorted(self.pending_calls.items()):
            yield ToolCallFrame(number, call_index, call["id"], call["name"], call["arguments"], streamed=True)
        reasons = [self.finish_reasons[number] for number in sorted(self.finish_reasons)]
        stops = [self.stop_reasons.get(number) for number in sorted(self.finish_reasons)]
        usage, details = self.usage or {}, self.usage_details
        if self.usage is None and last_said is not None:
            usage, details = usage_of(last_said)
        yield Done(reasons[0], reasons, usage, stops if any(s is not None for s in stops) else [], details)


def usage_said(chunk: dict[str, Any], ending: StreamEnding, counts: ChunkUsage | None) -> int:
    """A chunk's usage: the answer's (a chunk of no choices, or any where the usage so far
    was not asked) or a choice's so far (``counts``); the chunk's tokens (1: an upstream that
    names no token ids has a chunk counted one token)."""
    usage = chunk["usage"]
    if not isinstance(usage, dict):
        return 1
    if counts is not None and chunk.get("choices"):
        return counts.said(usage, chunk["choices"])
    ending.usage, ending.usage_details = usage_of(usage)
    return 1


class ChunkUsage:
    """The usage so far that an upstream asked for it (``continuous_usage_stats``) sends in
    each chunk of a choice, as vLLM does: the prompt's tokens, said with the choice's first
    token, and the choice's completion tokens so far, whose growth is the chunk's tokens."""

    __slots__ = ("completed", "last", "unsaid")

    def __init__(self) -> None:
        self.unsaid: dict[int, int | None] = {}  # per choice: its prompt's count, until its first token
        self.completed: dict[int, int] = {}  # per choice: its completion tokens so far
        self.last: dict[str, Any] | None = None  # the last usage said (the end's, if no other comes)

    def said(self, usage: dict[str, Any], choices: list[Any]) -> int:
        """A chunk's usage (of its one choice): the chunk's tokens (1 where it does not say)."""
        self.last = usage
        choice = choices[0] if len(choices) == 1 else None
        number = choice.get("index", 0) if isinstance(choice, dict) else None
        if type(number) is not int:
            return 1
        prompt = usage.get("prompt_tokens")
        if number not in self.unsaid:
            self.unsaid[number] = prompt if _a_count(prompt) else None
        so_far = usage.get("completion_tokens")
        if not _a_count(so_far):
            return 1
        before, self.completed[number] = self.completed.get(number, 0), so_far
        return max(0, so_far - before)

    def prompt(self, number: int) -> int | None:
        """The prompt's count for choice ``number``'s first token, once (then ``None``)."""
        count = self.unsaid.get(number)
        if count is not None:
            self.unsaid[number] = None
        return count


def _a_count(value: Any) -> TypeGuard[int]:
    """A count the log can hold (bigint), as ``usage_of`` keeps them."""
    return type(value) is int and 0 <= value < 2**62
