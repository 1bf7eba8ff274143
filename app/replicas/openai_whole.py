"""An OpenAI-compatible upstream's whole answer (``stream: false``), read as the frames its
stream would have given, with the prompt's log probabilities.

Why: vLLM gives the prompt's log probabilities (``prompt_logprobs``) only in an answer it
does not stream, and refuses a stream that asks for them. So where the client asked a whole
answer that carries them (docs/compatibility.md), an ``openai`` replica is asked unstreamed
(app/replicas/openai_upstream.py), and nothing reaches the client before its answer is
whole anyway: a failure before it is retried elsewhere, as any failure before the commit
point.

How this works: :class:`WholeBody` sends the request at the first read, reads the answer
whole and hands it over as the SSE chunks of the stream vLLM would have sent for it (each
choice's role, with what is said of the prompt; its message or text, with its log
probabilities and token ids, as one delta; its finish; the usage), which
:class:`~app.replicas.openai_stream.OpenAIStream` parses as any stream: no second parser.
:class:`WholeAnswerStream` gives each choice's first token the prompt's log probabilities
and the choice's tokens (the answer's completion tokens where it has one choice; else one,
as a streamed chunk counts). Its first frame comes with its last: the driver's first-token
deadline for it is ``first_token_hard_s`` (``unstreamed``, app/driver/attempt.py).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

import orjson

from app.replicas.base import Done, Frame, Token, UpstreamFailure
from app.replicas.openai_stream import OpenAIStream
from statemachine.deltas import CONTENT, PromptLogprobs
from statemachine.events import FailureKind
from statemachine.field_parsers import prompt_logprobs


class WholeBody:
    """The upstream's whole answer as the SSE body of its stream (see the module docstring):
    ``answer`` sends the request and returns the answer's body, read whole."""

    def __init__(self, answer: Callable[[], Awaitable[bytes]], *, chat: bool) -> None:
        self._answer: Callable[[], Awaitable[bytes]] | None = answer
        self._chat = chat
        self.prompt_logprobs: dict[int, PromptLogprobs] = {}  # per choice, as the answer said them
        self.tokens: dict[int, int] = {}  # per choice, its tokens where the answer says them

    async def read(self) -> bytes:
        answer, self._answer = self._answer, None
        if answer is None:
            return b""
        return self._chunks(_whole(await answer()))

    async def aclose(self) -> None:
        self._answer = None  # (the answer's own body is closed once read: openai_upstream.py)

    def _chunks(self, answer: dict[str, Any]) -> bytes:
        chunks: list[dict[str, Any]] = []
        choices = answer["choices"]
        usage = answer.get("usage")
        for choice in choices:
            number = choice["index"]
            said = answer.get("prompt_logprobs") if self._chat else choice.get("prompt_logprobs")
            if said is not None:
                self.prompt_logprobs[number] = _prompt_logprobs(said)
            if len(choices) == 1 and isinstance(usage, dict) and type(usage.get("completion_tokens")) is int:
                self.tokens[number] = usage["completion_tokens"]
            chunks.extend(_chat_chunks(answer, choice) if self._chat else _completion_chunks(choice))
        if usage is not None:
            chunks.append({"choices": [], "usage": usage})
        return b"".join(b"data: %s\n\n" % orjson.dumps(chunk) for chunk in chunks) + b"data: [DONE]\n\n"


class WholeAnswerStream:
    """The frames of an upstream's whole answer (see the module docstring)."""

    unstreamed = True  # its first frame comes with its last (app/driver/attempt.py)

    def __init__(self, body: WholeBody, choices: int) -> None:
        self._body = body
        self._stream = OpenAIStream(body, choices=choices)

    def frames(self) -> AsyncIterator[Frame]:
        return self._frames()

    async def _frames(self) -> AsyncGenerator[Frame, None]:
        said = self._body.prompt_logprobs
        seen: set[int] = set()
        async for frame in self._stream.frames():
            if isinstance(frame, Token) and frame.choice not in seen:  # the choice's first
                seen.add(frame.choice)
                frame.prompt_logprobs = said.pop(frame.choice, None)
                frame.tokens = self._body.tokens.get(frame.choice, frame.tokens)
            elif isinstance(frame, Done):
                for choice in sorted(said):  # a choice of no text: a delta of none carries them
                    yield Token(choice, 0, "", (), None, CONTENT, 0, prompt_logprobs=said.pop(choice))
            yield frame

    async def close(self) -> None:
        await self._stream.close()


def _whole(body: bytes) -> dict[str, Any]:
    """The upstream's whole answer, checked as far as it is read here."""
    try:
        answer = orjson.loads(body)
    except ValueError:
        answer = None
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list) or not all(
        isinstance(c, dict) and type(c.get("index")) is int and c["index"] >= 0 for c in choices
    ):
        raise UpstreamFailure(FailureKind.LIVENESS_UNCERTAIN, f"a malformed whole answer: {body[:200]!r}")
    assert isinstance(answer, dict)
    return answer


def _prompt_logprobs(said: Any) -> PromptLogprobs:
    """vLLM's ``prompt_logprobs`` (per prompt token null or ``{token id: {logprob, rank,
    decoded_token}}``) in the log's form."""
    try:
        return prompt_logprobs(
            [
                None
                if place is None
                else [[int(tid), p["logprob"], p.get("rank"), p.get("decoded_token")] for tid, p in place.items()]
                for place in said
            ]
        )
    except (TypeError, ValueError, AttributeError, KeyError) as exc:
        raise UpstreamFailure(FailureKind.LIVENESS_UNCERTAIN, f"malformed prompt_logprobs: {exc!r:.200}") from None


def _chat_chunks(answer: dict[str, Any], choice: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat choice's chunks as vLLM streams them: its role (with what is said of the
    prompt), its message as one delta (tool calls as one piece each), its finish."""
    number, message = choice["index"], choice.get("message") or {}
    opening: dict[str, Any] = {"choices": [{"index": number, "delta": {"role": message.get("role"), "content": ""}}]}
    for field in ("prompt_token_ids", "prompt_text"):
        if answer.get(field) is not None:
            opening[field] = answer[field]
    delta = {key: value for key, value in message.items() if key not in ("role", "tool_calls")}
    calls = message.get("tool_calls")
    if isinstance(calls, list) and calls:
        delta["tool_calls"] = [{"index": k, **call} if isinstance(call, dict) else call for k, call in enumerate(calls)]
    said = {"index": number, "delta": delta, "logprobs": choice.get("logprobs")}
    if choice.get("token_ids") is not None:
        said["token_ids"] = choice["token_ids"]
    ending = {"index": number, "delta": {}, "finish_reason": choice.get("finish_reason")}
    return [opening, {"choices": [said]}, {"choices": [ending | _stop(choice)]}]


def _completion_chunks(choice: dict[str, Any]) -> list[dict[str, Any]]:
    """A completion choice's chunks as vLLM streams them: its text (with its log
    probabilities, token ids and prompt's), its finish."""
    number = choice["index"]
    said = {"index": number, "text": choice.get("text"), "logprobs": choice.get("logprobs")}
    for field in ("token_ids", "prompt_token_ids"):
        if choice.get(field) is not None:
            said[field] = choice[field]
    ending = {"index": number, "text": "", "finish_reason": choice.get("finish_reason")}
    return [{"choices": [said]}, {"choices": [ending | _stop(choice)]}]


def _stop(choice: dict[str, Any]) -> dict[str, Any]:
    return {} if choice.get("stop_reason") is None else {"stop_reason": choice["stop_reason"]}
