"""The frames of one started attempt, parsed from the worker's response body.

The body is one JSON object per line (docs/worker-protocol.md). :class:`AttemptFrames`
reads it as :class:`BodyReads` (app/replicas/body_reads.py: the lean connections' body or
httpx's, whichever carried the start), splits what each read brought into lines and
builds the driver's own frames (app/replicas/base.py) straight from each: the per-frame
path is one ``json.loads`` and one small object per line. An ``error`` frame or a broken
transport ends iteration with a :class:`WorkerError`.

While the frames wait for the body's next read, a taker (``offer_tokens``: the request
loop's) may take token frames as their read arrives, in the connection's own callback
(``Body.tap``): only a read of whole lines that are all token frames without log
probabilities is offered, and what the taker declines is read and returned here as any
read, in order.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from collections import deque
from collections.abc import Callable
from typing import Any

import httpx

from app.contract import json_depth as deep_json
from app.contract.logprobs import from_wire
from app.replicas.base import (
    Done,
    Frame,
    Heartbeat,
    PooledAnswer,
    Token,
    ToolCallFrame,
    tool_call_piece_problem,
    usage_of,
)
from app.replicas.body_reads import BodyReads, read_offering
from app.replicas.worker_errors import AttemptEnded, MalformedFrame, ReplicaExiting, StreamBroken, transport_error
from statemachine.deltas import CONTENT, REASONING_FIELDS, TOOL_CALLS, Prompt, PromptLogprobs
from statemachine.events import FINISH_REASONS
from statemachine.field_parsers import prompt_logprobs

_loads = json.loads
_DRAIN_S = 0.5  # the worker ends the body right after done
_YIELD_EVERY = 16


class AttemptFrames:
    """The frames of one started attempt; iterate it, then it closes itself.

    Iteration ends after :class:`Done`; an ``error`` frame or a transport failure raises a
    :class:`WorkerError`. Use ``async with`` (or ``aclose``) if you stop reading early:
    closing mid-body closes the connection, which is how a cancel or a fence aborts.
    ``worker_id`` is the answer's ``x-phasegate-worker``.
    """

    def __init__(self, body: BodyReads, worker_id: str | None) -> None:
        self.worker_id = worker_id
        self.done = False
        self._body = body
        self._lines: deque[bytes] = deque()
        self._tail = b""
        self._until_yield = _YIELD_EVERY
        self._take: Callable[[list[Token]], bool] | None = None  # takes tokens as they arrive (``offer_tokens``)
        # per choice, the prompt's log probabilities of a ``prompt_logprobs`` frame, until its first token
        self._prompt_logprobs: dict[int, PromptLogprobs] = {}

    def offer_tokens(self, take: Callable[[list[Token]], bool]) -> None:
        """Offer ``take`` the tokens of each read as it arrives, in the connection's own
        callback, while the frames wait for the body's next read; those it takes are not
        returned. Only a read of whole lines, each a token frame without log
        probabilities, is offered (``_plain_token``): anything else (a heartbeat, a tool
        call, the end, an error), and tokens ``take`` declines, are read and returned as
        before. Over the lean connections only (``Body.tap``); over httpx a no-op."""
        self._take = take

    async def __aenter__(self) -> AttemptFrames:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._body.aclose()

    def __aiter__(self) -> AttemptFrames:
        return self

    async def __anext__(self) -> Frame:
        self._until_yield -= 1
        if not self._until_yield:
            # Reading buffered frames never suspends; without this a fast stream would
            # starve the caller's other tasks (its lease renewals above all).
            self._until_yield = _YIELD_EVERY
            await asyncio.sleep(0)
        if self._lines:
            return await self._frame(self._lines.popleft())
        if self.done:
            raise StopAsyncIteration
        # tokens may be taken as they arrive, between whole lines
        offer = self._tapped if self._take is not None and not self._tail else None
        while True:
            try:
                chunk = await read_offering(self._body, offer)
            except httpx.HTTPError as exc:
                await self.aclose()
                raise transport_error(exc) from exc
            if not chunk:
                await self.aclose()
                if self._tail:
                    raise MalformedFrame("the stream ended inside a frame", line=self._tail)
                raise StreamBroken("the stream ended without a done or error frame")
            if not self._tail and chunk.find(b"\n") == len(chunk) - 1:
                return await self._frame(chunk)  # the usual case: one whole frame per chunk
            lines = (self._tail + chunk).split(b"\n")
            self._tail = lines.pop()
            if lines:
                self._lines.extend(lines)
                return await self._frame(self._lines.popleft())
            offer = None  # part of a line came: the rest is read here

    def _tapped(self, received: bytes) -> bool:
        """A read offered by the body's tap: taken if it is plain token frames only, all of
        which ``take`` takes; otherwise nothing of it is used here (``__anext__`` reads it)."""
        take = self._take
        lines = received.split(b"\n")
        if take is None or lines.pop() or self._prompt_logprobs:  # not whole lines, or a choice's first is due
            return False
        tokens: list[Token] = []
        for line in lines:
            token = _plain_token(line)
            if token is None:
                return False
            tokens.append(token)
        return bool(tokens) and take(tokens)

    async def _finish(self) -> None:
        """Read the body's end after ``done``, so the connection is kept for the next
        attempt (closing a body mid-way closes its connection), then close."""
        with contextlib.suppress(httpx.HTTPError, TimeoutError):
            async with asyncio.timeout(_DRAIN_S):
                while await self._body.read():
                    pass
        await self.aclose()

    async def _frame(self, line: bytes) -> Frame:
        try:
            obj = _loads(line)
            kind = obj["type"]
            if kind == "token":
                logprobs = obj.get("logprobs")
                if logprobs is not None:
                    logprobs = from_wire(logprobs)
                key = obj.get("key", CONTENT)
                if key == TOOL_CALLS:  # a piece of the choice's tool calls, their JSON
                    problem = tool_call_piece_problem(json.loads(obj["text"]))
                    if problem is not None:
                        raise ValueError(problem)
                elif key != CONTENT and key not in REASONING_FIELDS:
                    raise ValueError(f"a token frame's text under {key!r}")
                ids = obj["token_ids"]
                if type(ids) is not list:
                    raise ValueError(f"token ids that are not a list: {ids!r}")
                # a frame names its tokens: one whose text a parser split off another's names none
                counted = obj.get("prompt_tokens")  # with a choice's first text, where asked
                if counted is not None and (type(counted) is not int or counted < 0):
                    raise ValueError(f"a prompt's token count that is not a count: {counted!r:.80}")
                token = Token(
                    obj["choice"], obj["index"], obj["text"], ids, logprobs, key, len(ids), _prompt(obj), counted
                )
                if self._prompt_logprobs:
                    token.prompt_logprobs = self._prompt_logprobs.pop(token.choice, None)
                return token
            if kind == "heartbeat":
                return Heartbeat(obj["phase"], obj["queue_position"])
            if kind == "tool_call":
                streamed = obj.get("streamed", False) is True  # its pieces went out as token frames
                return ToolCallFrame(obj["choice"], obj["index"], obj["id"], obj["name"], obj["arguments"], streamed)
            if kind == "done":
                usage, details = usage_of(obj["usage"])  # a reasoning parser's completion_tokens_details
                stops = obj.get("stop_reasons", [])
                if not isinstance(stops, list) or any(s is not None and type(s) not in (str, int) for s in stops):
                    raise ValueError(f"stop reasons that are not strings or token ids: {stops!r}")
                answer = _answer(obj["answer"]) if "answer" in obj else None  # a pooling request's
                frame = Done(obj["finish_reason"], obj["finish_reasons"], usage, stops, details, answer)
                if not FINISH_REASONS.issuperset((frame.finish_reason, *frame.finish_reasons)):
                    raise ValueError(f"unknown finish reason in {frame.finish_reasons!r}")
                self.done = True
                self._lines.clear()
                await self._finish()
                return frame
            if kind == "prompt_logprobs":  # said before the choice's first token frame
                choice = obj["choice"]
                if type(choice) is not int or choice < 0:
                    raise ValueError(f"a choice that is not an index: {choice!r:.80}")
                self._prompt_logprobs[choice] = prompt_logprobs(obj["logprobs"])
                code, message, generated = None, "", None
            elif kind == "error":
                code, message = obj["code"], obj["message"]
                generated = obj.get("generated_tokens")
            else:
                raise KeyError(kind)
        except (ValueError, KeyError, TypeError) as exc:
            await self.aclose()
            line = line.rstrip(b"\n")
            raise MalformedFrame(f"not a protocol frame ({exc!r}): {line[:200]!r}", line=line) from None
        if code is None:  # a prompt_logprobs frame: the next frame carries them
            return await self.__anext__()
        await self.aclose()
        if code == "replica_exiting":
            raise ReplicaExiting(message, code=code)
        raise AttemptEnded(message, code=code, generated_tokens=generated)


def _answer(said: Any) -> PooledAnswer:
    """A done frame's pooling answer: its JSON value (``json``) or bytes (``bytes``, base64),
    with its headers (docs/worker-protocol.md)."""
    headers = said["headers"]
    if not isinstance(headers, dict) or not all(isinstance(v, str) for v in headers.values()):
        raise ValueError(f"an answer's headers that are not strings: {headers!r:.200}")
    if "bytes" in said:
        return PooledAnswer(base64.b64decode(said["bytes"], validate=True), "application/octet-stream", headers)
    return PooledAnswer(deep_json.dumps(said["json"]).encode(), "application/json", headers)


def _prompt(obj: dict[str, Any]) -> Prompt | None:
    """What a choice's first token frame says of the prompt, where the client asked: its
    token ids and rendered text (each null where not asked); None in any other frame."""
    if "prompt_token_ids" not in obj:
        return None
    ids, text = obj["prompt_token_ids"], obj.get("prompt_text")
    if (ids is not None and (type(ids) is not list or not all(type(n) is int for n in ids))) or (
        text is not None and type(text) is not str
    ):
        raise ValueError(f"a malformed prompt in a token frame: {ids!r:.80} {text!r:.80}")
    return (None if ids is None else tuple(ids)), text


def _plain_token(line: bytes) -> Token | None:
    """The token of a token frame without log probabilities, as ``_frame`` builds it;
    ``None`` for any other line (which ``_frame`` then reads, and judges)."""
    try:
        obj = _loads(line)
    except ValueError:
        return None
    if (
        type(obj) is not dict
        or obj.get("type") != "token"
        or obj.get("logprobs") is not None
        or "key" in obj
        or "prompt_token_ids" in obj
        or "prompt_tokens" in obj
    ):
        return None
    choice, index, text, token_ids = obj.get("choice"), obj.get("index"), obj.get("text"), obj.get("token_ids")
    if type(choice) is not int or type(index) is not int or type(text) is not str or type(token_ids) is not list:
        return None
    return Token(choice, index, text, token_ids, None, tokens=len(token_ids))
