"""OpenAI response bodies and their SSE framing.

Chunks are built from a per-request JSON prefix and suffix around the one part that
changes (the delta). A content delta without log probabilities, the one event of the
per-token path, is a whole SSE event put together from pre-encoded bytes around the
text's JSON (``content_event``): no dict, no string formatting, one ``orjson.dumps``.
SSE events are encoded here as bytes (``id:`` then ``data:``) and handed to
sse-starlette as they are.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import orjson

from app.contract.logprobs import TokenLogprob
from app.driver.request import CHAT, GenerationRequest

DONE = b"data: [DONE]\n\n"


def sse_event(event_id: int | str, payload: str) -> bytes:
    """One SSE event; ``payload`` is JSON text, which never holds a raw newline."""
    return f"id: {event_id}\ndata: {payload}\n\n".encode()


def response_id(request: GenerationRequest, request_id: str) -> str:
    """The OpenAI id of the response to ``request``, from the gateway's request id."""
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


class ResponseShape:
    """Builds the bodies of one request's response, streamed or not."""

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
        self._text_offsets: dict[int, int] = {}  # per choice: characters sent (completions' text_offset)
        self._content_templates: dict[tuple[int, bool], tuple[bytes, bytes]] = {}  # (choice, first): around the text

    def _object(self, *, stream: bool) -> str:
        if self.chat:
            return "chat.completion.chunk" if stream else "chat.completion"
        return "text_completion"

    def content_chunk(
        self, text: str, choice: int = 0, *, first: bool = False, logprobs: Sequence[TokenLogprob] | None = None
    ) -> str:
        """A chunk carrying generated text (and its tokens' log probabilities, when asked for)."""
        if self.chat:
            role = '"role":"assistant",' if first else ""
            delta = f'"delta":{{{role}"content":{_dumps(text)}}}'
        else:
            delta = f'"text":{_dumps(text)}'
        rendered = "null"
        if logprobs is not None:
            offset = self._text_offsets.get(choice, 0)
            rendered = _dumps(render_logprobs(logprobs, chat=self.chat, text_offset=offset))
            self._text_offsets[choice] = offset + len(text)
        return (
            f'{self._head},"choices":[{{"index":{choice},{delta},"logprobs":{rendered},"finish_reason":null}}]'
            f"{self._usage_tail}"
        )

    def content_event(
        self,
        event_id: int,
        text: str,
        choice: int = 0,
        *,
        first: bool = False,
        logprobs: Sequence[TokenLogprob] | None = None,
    ) -> bytes:
        """The SSE event of ``content_chunk``: the same bytes as ``sse_event(event_id,
        content_chunk(...))``, built from the choice's pre-encoded prefix and suffix."""
        if logprobs is not None:
            return sse_event(event_id, self.content_chunk(text, choice, first=first, logprobs=logprobs))
        template = self._content_templates.get((choice, first))
        if template is None:
            before, _, after = self.content_chunk("\0", choice, first=first).rpartition('"\\u0000"')
            template = self._content_templates[(choice, first)] = (
                f"\ndata: {before}".encode(),
                f"{after}\n\n".encode(),
            )
        return b"id: %d%s%s%s" % (event_id, template[0], _text_json(text), template[1])

    def passed(self, text: str, choice: int = 0) -> None:
        """Text of ``choice`` sent before (a resumed stream): later tokens' offsets follow it."""
        self._text_offsets[choice] = self._text_offsets.get(choice, 0) + len(text)

    def tool_calls_chunk(self, tool_calls: list[dict[str, Any]], choice: int = 0, *, first: bool = False) -> str:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(tool_calls)]
        choices = [{"index": choice, "delta": delta, "logprobs": None, "finish_reason": None}]
        return f'{self._head},"choices":{_dumps(choices)}{self._usage_tail}'

    def finish_chunk(self, finish_reason: str, choice: int = 0) -> str:
        body: dict[str, Any] = {"index": choice, "logprobs": None, "finish_reason": finish_reason}
        if self.chat:
            body["delta"] = {}
        else:
            body["text"] = ""
        return f'{self._head},"choices":[{_dumps(body)}]{self._usage_tail}'

    def usage_chunk(self, usage: dict[str, int]) -> str:
        return f'{self._head},"choices":[],"usage":{_dumps(usage)}}}'

    def completion(
        self,
        texts: list[str],
        finish_reasons: list[str],
        usage: dict[str, int],
        tool_calls: list[list[dict[str, Any]]] | None = None,
        logprobs: list[list[TokenLogprob]] | None = None,
    ) -> dict[str, Any]:
        """The whole non-streamed response (``logprobs``: per choice, when asked for)."""
        choices: list[dict[str, Any]] = []
        for index, (text, finish_reason) in enumerate(zip(texts, finish_reasons, strict=True)):
            calls = tool_calls[index] if tool_calls else []
            rendered = None if logprobs is None else render_logprobs(logprobs[index], chat=self.chat, text_offset=0)
            if self.chat:
                message: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
                if calls:
                    message["tool_calls"] = calls
                choices.append(
                    {"index": index, "message": message, "logprobs": rendered, "finish_reason": finish_reason}
                )
            else:
                choices.append({"index": index, "text": text, "logprobs": rendered, "finish_reason": finish_reason})
        return {
            "id": self.response_id,
            "object": self._object(stream=False),
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage,
        }


def render_logprobs(entries: Sequence[TokenLogprob], *, chat: bool, text_offset: int) -> dict[str, Any]:
    """Tokens' log probabilities as OpenAI sends them: chat's ``content`` list, or the legacy
    completions' columns (``text_offset``: where the first token starts in the choice's text)."""
    if chat:
        return {
            "content": [
                {
                    "token": token,
                    "logprob": logprob,
                    "bytes": list(token.encode("utf-8", "replace")),
                    "top_logprobs": [
                        {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8", "replace"))} for t, lp in top
                    ],
                }
                for token, logprob, top in entries
            ]
        }
    offsets = []
    for token, _, _ in entries:
        offsets.append(text_offset)
        text_offset += len(token)
    return {
        "tokens": [token for token, _, _ in entries],
        "token_logprobs": [logprob for _, logprob, _ in entries],
        "top_logprobs": [dict(top) for _, _, top in entries],
        "text_offset": offsets,
    }
