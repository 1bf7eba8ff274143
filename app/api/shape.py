"""What every API's answer shape does: the one interface the stream, the follower of the log
and the whole answer use, whichever API the client called (docs/design.md §17).

Each API has a shape in its room (``app/api/chat/shape.py``, ``app/api/responses/shape.py``,
``app/api/messages/shape.py``) that turns the driver's outputs, or the deltas the log holds,
into that API's bytes: a streamed delta's events, the stream's ending or its failure, and
the whole answer. :func:`app.api.answers.shape_for` picks the one a request came by.

Two ways of numbering a stream exist. A chat stream's event ids are its delta indexes: a
reader that has deltas up to ``k`` is sent deltas ``k+1…``, and a chat choice opens with
its role chunk (``from_the_start``, ``opening``) where its reader gets it from its first
delta. An API whose events are numbered apart from its deltas (``numbered``: the Responses
API's ``sequence_number``, the Messages API's ids) is rebuilt from its first delta, its
shape leaving out the events up to the reader's (``after``). The defaults below are what
a numbered shape does with the chat shape's hooks: nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import orjson

from app.contract.logprobs import TokenLogprob
from app.driver.request import GenerationRequest
from statemachine.deltas import CONTENT, TOOL_CALLS, Prompt, PromptLogprobs


class Shape(Protocol):
    """Builds the bodies of one request's answer in the API its client called."""

    numbered: ClassVar[bool]  # its events are numbered apart from its deltas (see the module's docstring)
    request: GenerationRequest
    response_id: str  # the id the client sees: chatcmpl-, cmpl-, resp_, msg_…
    created: int
    model: str  # the model that answered: a fallback's, if one did
    after: int = -1  # a numbered stream's events up to this one are left out (its reader has them)
    unopened: set[int] | None = None  # choices whose opening chunk is still due (``from_the_start``)

    def from_the_start(self) -> None:
        """The stream is sent from its first delta: where the API opens each choice with a
        chunk of its own (chat's role), it is due before the choice's first delta."""
        return None

    def opening(self, choice: int, prompt: Prompt | None = None, prompt_tokens: int | None = None) -> bytes:
        """The chunk that opens ``choice`` before its first delta, once, where one is due."""
        return b""

    def passed(self, text: str, choice: int = 0, tokens: int = 0, prompt_tokens: int | None = None) -> None:
        """A delta of ``choice`` the reader had (a resumed stream), where later chunks count
        it: the offsets of their text, the usage so far."""
        return None

    def content_event(
        self,
        event_id: int,
        text: str,
        choice: int = 0,
        *,
        key: str = CONTENT,
        logprobs: Sequence[TokenLogprob] | None = None,
        token_ids: Sequence[int] = (),
        prompt: Prompt | None = None,
        tokens: int = 1,
        prompt_tokens: int | None = None,
    ) -> bytes:
        """The events of one delta (under ``tool_calls``: their JSON) of ``tokens`` tokens; a
        choice's first says its prompt's tokens where the replica said them (``prompt_tokens``)."""
        ...

    def tool_calls_event(self, event_id: int, calls: list[dict[str, Any]], choice: int = 0) -> bytes:
        """A choice's tool calls, whole, as the replica sent them at its end."""
        ...

    def ending(
        self,
        event_id: int,
        finish_reasons: Sequence[str],
        stop_reasons: Sequence[str | int | None],
        usage: dict[str, Any],
    ) -> bytes:
        """The stream's last events after its last delta, in one write."""
        ...

    def failure_event(self, event_id: int, body: dict[str, Any]) -> bytes:
        """The stream's end after a failure: its error (docs/design.md §6)."""
        ...

    def completion(
        self,
        answers: Sequence[ChoiceAnswer],
        finish_reasons: Sequence[str],
        usage: dict[str, Any],
        stop_reasons: Sequence[str | int | None] = (),
    ) -> dict[str, Any]:
        """The whole answer (``stream: false``)."""
        ...


@dataclass
class ChoiceAnswer:
    """One choice of a whole answer, as its deltas come: their texts by key (content,
    reasoning…), their tokens' log probabilities, and the choice's tool calls."""

    texts: dict[str, list[str]] = field(default_factory=dict)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    prompt: Prompt | None = None  # what the replica said of the choice's prompt
    prompt_logprobs: PromptLogprobs | None = None  # the prompt's log probabilities, where asked
    _calls: dict[int, dict[str, Any]] = field(default_factory=dict)  # tool calls by their index

    def add(
        self,
        key: str,
        text: str,
        logprobs: Sequence[TokenLogprob] | None,
        token_ids: Sequence[int] = (),
        prompt: Prompt | None = None,
        prompt_logprobs: PromptLogprobs | None = None,
    ) -> None:
        self.logprobs.extend(logprobs or ())
        self.token_ids.extend(token_ids)
        self.prompt = prompt or self.prompt
        self.prompt_logprobs = self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs
        if key != TOOL_CALLS:
            self.texts.setdefault(key, []).append(text)
            return
        for place, piece in enumerate(orjson.loads(text)):  # whole calls, or a piece of them
            index = piece.get("index", place)
            function = piece.get("function") or {}
            call = self._calls.get(index)
            if call is None:
                call = self._calls[index] = {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
                self.tool_calls.append(call)
            call["id"] = call["id"] or piece.get("id")
            call["function"]["name"] += function.get("name") or ""
            call["function"]["arguments"] += function.get("arguments") or ""
