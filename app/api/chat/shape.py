"""OpenAI response bodies and their SSE framing.

Chunks are built from a per-request JSON prefix and suffix around the one part that
changes (the delta). A text delta without log probabilities, the one event of the
per-token path, is a whole SSE event put together from pre-encoded bytes around the
text's JSON (``content_event``): no dict, no string formatting, one ``orjson.dumps``.
SSE events are encoded here as bytes (``id:`` then ``data:``) and handed to
sse-starlette as they are.

A chat stream's deltas carry their text under the key the replica gave it (``content``,
``reasoning``…, docs/design.md §14), and each choice's first delta is preceded, as vLLM
streams it, by a chunk of its role and empty content (``opening``: no id, since
event ids are delta indexes).

Where the client asked for the usage in every chunk (``continuous_usage_stats``), each
chunk of a choice carries that choice's usage so far, as vLLM's do (app/api/chat/usage.py;
a finish of a one-choice answer: the replica's count). Those chunks are built whole, never
from a template.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import orjson

from app.api.chat.logprobs import render_logprobs, render_prompt_logprobs
from app.api.chat.usage import UsageSoFar, in_order
from app.api.shape import ChoiceAnswer, Shape
from app.contract.logprobs import TokenLogprob
from app.driver.request import CHAT, GenerationRequest
from statemachine.deltas import CONTENT, NO_TEXT, REASONING_FIELDS, TOOL_CALLS, Prompt

DONE = b"data: [DONE]\n\n"


def sse_event(event_id: int | str, payload: str) -> bytes:
    """One SSE event; ``payload`` is JSON text, which never holds a raw newline."""
    return f"id: {event_id}\ndata: {payload}\n\n".encode()


def completion_id(request: GenerationRequest, request_id: str) -> str:
    """The OpenAI id of the chat completion or completion answering ``request``, from the gateway's request id."""
    prefix = "chatcmpl" if request.endpoint == CHAT else "cmpl"
    return f"{prefix}-{request_id.removeprefix('req_')}"


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _text_json(text: str) -> bytes:
    """``text`` as a JSON string in UTF-8: the bytes of ``_dumps(text).encode()`` (orjson
    escapes as the standard library does with ``ensure_ascii=False``), and its error for
    text that is not Unicode (a lone surrogate, which orjson refuses too)."""
    try:
        return orjson.dumps(text)
    except TypeError:
        return _dumps(text).encode()


class ChatShape(Shape):
    """Builds the bodies of one chat completion's or completion's answer, streamed or not."""

    numbered = False  # its event ids are its delta indexes

    def __init__(self, request: GenerationRequest, response_id: str, created: int, model: str | None = None) -> None:
        self.request = request
        self.model = model or request.model  # the model that answered: a fallback's, if one did
        self.chat = request.endpoint == CHAT
        self.response_id = response_id
        self.created = created
        head = {
            "id": response_id,
            "object": self._object(stream=True),
            "created": created,
            "model": self.model,
        }
        self._head = _dumps(head)[:-1]  # without the closing brace
        self._usage_tail = ',"usage":null}' if request.include_usage else "}"
        # the usage so far in every chunk, where asked (see the module's docstring)
        self.usage = UsageSoFar(request) if request.continuous_usage else None
        self._text_offsets: dict[int, int] = {}  # per choice: characters sent (completions' text_offset)
        self._content_templates: dict[tuple[int, str], tuple[bytes, bytes]] = {}  # (choice, key): around the text
        self.unopened: set[int] | None = None  # chat choices whose role chunk is still to go (``from_the_start``)

    def _object(self, *, stream: bool) -> str:
        if self.chat:
            return "chat.completion.chunk" if stream else "chat.completion"
        return "text_completion"

    def from_the_start(self) -> None:
        """The stream is sent from its first delta: each chat choice opens with its role
        chunk (a client resuming later had them)."""
        if self.chat:
            self.unopened = set(range(self.request.choices))

    def opening(self, choice: int, prompt: Prompt | None = None, prompt_tokens: int | None = None) -> bytes:
        """The chunk that opens ``choice`` before its first delta, its role and no text,
        and what the replica said of the prompt there, once (after ``from_the_start``);
        empty otherwise."""
        if self.usage is not None:
            self.usage.said(choice, prompt_tokens)
        unopened = self.unopened
        if unopened is None or choice not in unopened:
            return b""
        unopened.remove(choice)
        if not unopened:
            self.unopened = None  # every choice is open: nothing more to look at a delta
        body = {"index": choice, "delta": {"role": self.request.response_role, "content": ""}}
        body |= {"logprobs": None, "finish_reason": None}
        said = _prompt_fields(prompt)
        if self.usage is not None:  # vLLM's order: the usage before the prompt's fields
            return f'data: {self._head},"choices":[{_dumps(body)}]{self.usage.member(choice)}{said}}}\n\n'.encode()
        return f'data: {self._head},"choices":[{_dumps(body)}]{said}{self._usage_tail}\n\n'.encode()

    def _tail(self, choice: int, completed: int | None = None) -> str:
        """The end of a chunk of ``choice``: its usage so far where asked (``completed``: its
        completion tokens, where not those of its deltas), else ``null`` or nothing."""
        return self._usage_tail if self.usage is None else self.usage.member(choice, completed) + "}"

    def content_chunk(
        self,
        text: str,
        choice: int = 0,
        *,
        key: str = CONTENT,
        logprobs: Sequence[TokenLogprob] | None = None,
        token_ids: Sequence[int] = (),
        prompt: Prompt | None = None,
    ) -> str:
        """A chunk carrying generated text under ``key`` (and its tokens' log
        probabilities and ids, when asked for; a completion's first, what the replica said
        of its prompt); under ``tool_calls``, their JSON."""
        if key == TOOL_CALLS:
            return self.tool_calls_chunk(orjson.loads(text), choice, logprobs, token_ids)
        delta = f'"delta":{{{_dumps(key)}:{_dumps(text)}}}' if self.chat else f'"text":{_dumps(text)}'
        if self.chat and key == NO_TEXT:
            delta = '"delta":{}'
        rendered = "null"
        if logprobs is not None:
            offset = self._text_offsets.get(choice, 0)
            rendered = _dumps(render_logprobs(logprobs, chat=self.chat, text_offset=offset))
            self._text_offsets[choice] = offset + len(text)
        more = self._ids_field(token_ids)
        if prompt is not None and prompt[0] is not None and not self.chat:  # (chat's: in its opening)
            more += f',"prompt_token_ids":{_dumps(prompt[0])}'
        return (
            f'{self._head},"choices":[{{"index":{choice},{delta},"logprobs":{rendered},"finish_reason":null{more}}}]'
            f"{self._tail(choice)}"
        )

    def _ids_field(self, token_ids: Sequence[int]) -> str:
        """A choice's ``token_ids`` field, where the client asked for them (vLLM's return_token_ids)."""
        return f',"token_ids":{_dumps(list(token_ids))}' if self.request.return_token_ids else ""

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
        """The SSE event of ``content_chunk``: the same bytes as ``sse_event(event_id,
        content_chunk(...))``, built from the choice's pre-encoded prefix and suffix (a
        chunk with the usage so far: whole, after its ``tokens`` counted)."""
        if self.usage is not None:
            self.usage.count(choice, tokens, prompt_tokens)
            chunk = self.content_chunk(text, choice, key=key, logprobs=logprobs, token_ids=token_ids, prompt=prompt)
            return sse_event(event_id, chunk)
        if logprobs is not None or key == TOOL_CALLS or token_ids or prompt is not None:
            chunk = self.content_chunk(text, choice, key=key, logprobs=logprobs, token_ids=token_ids, prompt=prompt)
            return sse_event(event_id, chunk)
        template = self._content_templates.get((choice, key))
        if template is None:
            before, _, after = self.content_chunk("\0", choice, key=key).rpartition('"\\u0000"')
            template = self._content_templates[(choice, key)] = (
                f"\ndata: {before}".encode(),
                f"{after}\n\n".encode(),
            )
        return b"id: %d%s%s%s" % (event_id, template[0], _text_json(text), template[1])

    def passed(self, text: str, choice: int = 0, tokens: int = 0, prompt_tokens: int | None = None) -> None:
        """A delta of ``choice`` sent before (a resumed stream): later tokens' offsets follow
        its text, and the usage so far counts its tokens."""
        self._text_offsets[choice] = self._text_offsets.get(choice, 0) + len(text)
        if self.usage is not None:
            self.usage.count(choice, tokens, prompt_tokens)

    def tool_calls_chunk(
        self,
        tool_calls: list[dict[str, Any]],
        choice: int = 0,
        logprobs: Sequence[TokenLogprob] | None = None,
        token_ids: Sequence[int] = (),
    ) -> str:
        """A chunk of a choice's tool calls: whole, or a piece of them as the replica
        streamed it, each naming the call it adds to by its ``index`` (a whole one: its place)."""
        delta: dict[str, Any] = {"tool_calls": [{"index": i, **call} for i, call in enumerate(tool_calls)]}
        rendered = None if logprobs is None else render_logprobs(logprobs, chat=True, text_offset=0)
        body: dict[str, Any] = {"index": choice, "delta": delta, "logprobs": rendered, "finish_reason": None}
        if self.request.return_token_ids:
            body["token_ids"] = list(token_ids)
        return f'{self._head},"choices":[{_dumps(body)}]{self._tail(choice)}'

    def finish_chunk(
        self, finish_reason: str, choice: int = 0, stop_reason: str | int | None = None, completed: int | None = None
    ) -> str:
        body: dict[str, Any] = {"index": choice, "logprobs": None, "finish_reason": finish_reason}
        if self.chat:
            body["delta"] = {}
        else:
            body["text"] = ""
        if stop_reason is not None:
            body["stop_reason"] = stop_reason
        return f'{self._head},"choices":[{_dumps(body)}]{self._tail(choice, completed)}'

    def finish_events(
        self,
        event_id: int,
        finish_reasons: Sequence[str],
        stop_reasons: Sequence[str | int | None],
        usage: dict[str, Any] | None = None,
    ) -> list[bytes]:
        """Each choice's finish (and stop reason, where one is known), from ``event_id`` on;
        a one-choice answer's usage so far is the replica's count (``usage``), which holds
        the tokens no delta carried (the end of a sequence)."""
        whole = (usage or {}).get("completion_tokens") if len(finish_reasons) == 1 else None
        return [
            sse_event(event_id + choice, self.finish_chunk(reason, choice, _nth(stop_reasons, choice), whole))
            for choice, reason in enumerate(finish_reasons)
        ]

    def usage_chunk(self, usage: dict[str, Any]) -> str:
        """The usage at the end; after the usage so far, in one order (a resumed stream's too)."""
        return f'{self._head},"choices":[],"usage":{_dumps(usage if self.usage is None else in_order(usage))}}}'

    def tool_calls_event(self, event_id: int, calls: list[dict[str, Any]], choice: int = 0) -> bytes:
        """A choice's tool calls, whole, in one event (after its role chunk, if still due)."""
        return self.opening(choice) + sse_event(event_id, self.tool_calls_chunk(calls, choice))

    def ending(
        self,
        event_id: int,
        finish_reasons: Sequence[str],
        stop_reasons: Sequence[str | int | None],
        usage: dict[str, Any],
    ) -> bytes:
        """The stream's last events, in one write: each choice's finish, the usage when
        asked for, ``[DONE]``."""
        events = self.finish_events(event_id, finish_reasons, stop_reasons, usage)
        if self.request.include_usage:
            events.append(sse_event(event_id + len(events), self.usage_chunk(usage)))
        return b"".join([*events, DONE])

    def failure_event(self, event_id: int, body: dict[str, Any]) -> bytes:
        """The stream's end after a failure: its error (docs/design.md §6), then ``[DONE]``."""
        return sse_event(event_id, json.dumps(body)) + DONE

    def completion(
        self,
        answers: Sequence[ChoiceAnswer],
        finish_reasons: Sequence[str],
        usage: dict[str, Any],
        stop_reasons: Sequence[str | int | None] = (),
    ) -> dict[str, Any]:
        """The whole non-streamed response: each choice's texts by key, tool calls and
        log probabilities (when asked for), and how it finished."""
        choices: list[dict[str, Any]] = []
        for index, (answer, finish_reason) in enumerate(zip(answers, finish_reasons, strict=True)):
            logprobs = answer.logprobs if self.request.logprobs is not None else None
            rendered = None if logprobs is None else render_logprobs(logprobs, chat=self.chat, text_offset=0)
            content = "".join(answer.texts.get(CONTENT, ()))
            if self.chat:
                message: dict[str, Any] = {"role": self.request.response_role, "content": content}
                for key, pieces in answer.texts.items():
                    if key not in (CONTENT, NO_TEXT):
                        message[key] = "".join(pieces)
                if not content and REASONING_FIELDS & message.keys():
                    message["content"] = None  # all reasoning: vLLM's reasoning parser says no content
                if answer.tool_calls:
                    message["tool_calls"] = answer.tool_calls
                choice: dict[str, Any] = {"index": index, "message": message}
            else:
                choice = {"index": index, "text": content}
            choice |= {"logprobs": rendered, "finish_reason": finish_reason}
            if _nth(stop_reasons, index) is not None:
                choice["stop_reason"] = stop_reasons[index]
            if self.request.return_token_ids:
                choice["token_ids"] = answer.token_ids
            if not self.chat and answer.prompt_logprobs is not None:  # vLLM's order: before the prompt's ids
                choice["prompt_logprobs"] = render_prompt_logprobs(answer.prompt_logprobs)
            if self.request.return_token_ids and not self.chat and answer.prompt is not None:
                choice["prompt_token_ids"] = answer.prompt[0]
            choices.append(choice)
        body = {
            "id": self.response_id,
            "object": self._object(stream=False),
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage,
        }
        said_logprobs = next((a.prompt_logprobs for a in answers if a.prompt_logprobs is not None), None)
        if self.chat and said_logprobs is not None:  # the prompt's, once for the answer, as vLLM's
            body["prompt_logprobs"] = render_prompt_logprobs(said_logprobs)
        said = next((answer.prompt for answer in answers if answer.prompt is not None), None)
        if self.chat and said is not None:  # the prompt's, once for the answer
            prompt_token_ids, prompt_text = said
            if self.request.return_token_ids and prompt_token_ids is not None:
                body["prompt_token_ids"] = prompt_token_ids
            if prompt_text is not None:
                body["prompt_text"] = prompt_text
        return body


def _prompt_fields(prompt: Prompt | None) -> str:
    """A chat chunk's fields of what the replica said of the prompt (JSON members, each
    led by a comma), as vLLM puts them in a choice's opening chunk."""
    if prompt is None:
        return ""
    token_ids, text = prompt
    fields = "" if token_ids is None else f',"prompt_token_ids":{_dumps(token_ids)}'
    return fields if text is None else f'{fields},"prompt_text":{_dumps(text)}'


def _nth(stop_reasons: Sequence[str | int | None], choice: int) -> str | int | None:
    """A choice's stop reason; ``None`` where none is known (a log written before them)."""
    return stop_reasons[choice] if choice < len(stop_reasons) else None
