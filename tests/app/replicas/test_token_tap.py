"""Tokens taken as their reads arrive (``OpenAIStream.offer_tokens`` and
``AttemptFrames.offer_tokens`` over the lean connections' ``Body.tap``): which reads are
offered, that what is taken is never yielded and what is not is yielded in order, over
a real socket whose server sends each part of its answer as a read of its own."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import orjson
import pytest

from app.driver.token_deltas import delta_of
from app.replicas.attempt_frames import AttemptFrames
from app.replicas.base import Done, Frame, Token
from app.replicas.openai_stream import OpenAIStream, _Template
from app.replicas.upstream_http import Connections

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def event(text: str | None = None, *, finish: str | None = None, **extra: object) -> bytes:
    choice: dict[str, object] = {"index": 0, "delta": {} if text is None else {"content": text}}
    choice["finish_reason"] = finish
    choice.update(extra)
    return b"data: " + orjson.dumps({"id": "x", "object": "chat.completion.chunk", "choices": [choice]}) + b"\n\n"


END = chunk(event(finish="stop")) + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"


class Stepped:
    """A server that answers one request, one part a step: ``send`` each part when the
    test says, so that each arrives at the gateway as a read of its own."""

    def __init__(self) -> None:
        self.parts: asyncio.Queue[bytes] = asyncio.Queue()
        self.server: asyncio.Server | None = None

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0]))
        while part := await self.parts.get():
            writer.write(part)
            await writer.drain()
        writer.close()

    async def __aenter__(self) -> Connections:
        self.server = await asyncio.start_server(self.serve, "127.0.0.1", 0)
        self.connections = Connections("127.0.0.1", self.server.sockets[0].getsockname()[1], connect_timeout_s=1.0)
        return self.connections

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.parts.put_nowait(b"")
        self.connections.close()
        self.server.close()
        await asyncio.sleep(0.01)  # the transports close


class Reading:
    """The stream's frames read by a task of their own (as the request loop reads them),
    and the tokens offered to ``take``."""

    def __init__(self, stream: OpenAIStream | AttemptFrames, accept: bool | list[bool] = True) -> None:
        self.yielded: list[Frame] = []
        self.offered: list[list[str]] = []
        self.taken: list[Token] = []
        self.accept = accept
        stream.offer_tokens(self.take)
        frames = stream.frames() if isinstance(stream, OpenAIStream) else stream
        self.task = asyncio.ensure_future(self.read(frames))

    def take(self, tokens: list[Token]) -> bool:
        self.offered.append([token.text for token in tokens])
        accept = self.accept if isinstance(self.accept, bool) else self.accept.pop(0)
        if accept:
            self.taken.extend(tokens)
        return accept

    async def read(self, frames: AsyncIterator[Frame]) -> None:
        async for frame in frames:
            self.yielded.append(frame)

    def yielded_texts(self) -> list[str]:
        return [frame.text for frame in self.yielded if isinstance(frame, Token)]


async def send(server: Stepped, part: bytes) -> None:
    server.parts.put_nowait(part)
    for _ in range(20):  # the write, the read, the callback: a few turns of the loop
        await asyncio.sleep(0.005)


async def answered(server: Stepped, connections: Connections) -> OpenAIStream:
    server.parts.put_nowait(HEAD + chunk(event("a")))
    answer = await connections.post(b"/v1/chat/completions", b"", b"{}")
    return OpenAIStream(answer.body, choices=1)


async def test_tokens_that_come_while_the_frames_wait_are_taken_in_the_read_and_not_yielded() -> None:
    server = Stepped()
    async with server as connections:
        stream = await answered(server, connections)
        reading = Reading(stream)
        for text in ("b", "c"):
            await send(server, chunk(event(text)))
        await send(server, chunk(event("d")) + chunk(event("e")))  # two events in one read
        await send(server, END)
        await asyncio.wait_for(reading.task, 5)
        await stream.close()
    assert reading.yielded_texts() == ["a"]  # read by the frames before anything was offered
    assert reading.offered == [["b"], ["c"], ["d", "e"]]
    assert [(t.text, t.index) for t in reading.taken] == [("b", 1), ("c", 2), ("d", 3), ("e", 4)]
    assert isinstance(reading.yielded[-1], Done) and reading.yielded[-1].finish_reasons == ["stop"]


async def test_tokens_declined_are_yielded_in_order_and_the_next_read_is_offered_again() -> None:
    server = Stepped()
    async with server as connections:
        stream = await answered(server, connections)
        reading = Reading(stream, accept=[False, True])
        for text in ("b", "c"):
            await send(server, chunk(event(text)))
        await send(server, END)
        await asyncio.wait_for(reading.task, 5)
        await stream.close()
    assert reading.offered == [["b"], ["c"]]
    assert reading.yielded_texts() == ["a", "b"] and [t.text for t in reading.taken] == ["c"]
    assert [frame.index for frame in reading.yielded if isinstance(frame, Token)] == [0, 1]
    assert reading.taken[0].index == 2


@pytest.mark.parametrize(
    "read",
    [
        chunk(event("b", finish="length")),  # a finish
        chunk(event("b", logprobs={"content": []})),  # log probabilities
        chunk(event(None).replace(b'"delta":{}', b'"delta":{"tool_calls":[{"index":0}]}')),
        chunk(event("b")) + chunk(b'data: {"id":"x","choices":[],"usage":{"total_tokens":3}}\n\n'),  # usage
        chunk(b'data: {"error":{"message":"boom"}}\n\n'),  # an error
        chunk(event("b").replace(b"\n\n", b"\r\n\r\n")),  # CR line ends
        chunk(b": a comment\n\n") + chunk(event("b")),  # a comment
        chunk(event("b")[:20]),  # half an event
        chunk(event("b"))[:15],  # half a chunk
        chunk(event("b", token_ids=[5])),  # a choice's field the token does not carry
        chunk(event("b").replace(b'"id":"x"', b'"id":"x","prompt_text":"p"')),  # a chunk's field
        chunk(event(None).replace(b'"delta":{}', b'"delta":{"reasoning":"r"}')),  # reasoning
    ],
    ids=[
        *("finish", "logprobs", "tool-call", "usage", "error", "crlf", "comment", "half-event", "half-chunk"),
        *("token-ids", "prompt-text", "reasoning"),
    ],
)
async def test_a_read_that_is_not_plain_tokens_only_is_never_offered(read: bytes) -> None:
    server = Stepped()
    async with server as connections:
        stream = await answered(server, connections)
        reading = Reading(stream)
        await send(server, chunk(event("b")))  # a plain token first: its bytes teach the template
        await send(server, read)
        await send(server, b"0\r\n\r\n")  # whatever the read left, the body ends
        await asyncio.wait_for(asyncio.gather(reading.task, return_exceptions=True), 5)
        await stream.close()
    assert reading.offered == [["b"]]


TEXTS = ["c", 'a "quoted" word', "back\\slash", "line\nbreak", "é中文🙂", "\u2028", "\x00", "{}"]


async def test_plain_tokens_after_the_first_are_read_by_the_streams_template_as_parsed() -> None:
    server = Stepped()
    async with server as connections:
        stream = await answered(server, connections)
        reading = Reading(stream)
        await send(server, chunk(event("b")))
        for text in TEXTS:
            await send(server, chunk(event(text)))
        await send(server, END)
        await asyncio.wait_for(reading.task, 5)
        await stream.close()
    assert [t.text for t in reading.taken] == ["b", *TEXTS]
    assert [t.index for t in reading.taken] == list(range(1, len(TEXTS) + 2))
    assert stream._template is not None  # learned from "b"; the later ones were read by it


def sse(text: str | None = None, **extra: object) -> bytes:
    """An event as the tap sees it: split off from the ones after it."""
    return event(text, **extra).removesuffix(b"\n\n")


def test_a_template_reads_only_the_events_that_parsing_would_read_as_its_tokens() -> None:
    template = _Template.learned(sse("b"), Token(0, 0, "b", (), None))
    assert template is not None
    token = template.token(sse("new text"), 7)
    assert token is not None and (token.choice, token.index, token.text) == (0, 7, "new text")
    for other in [
        sse(""),  # empty text: no token
        sse("b", finish="length"),
        sse("b", logprobs={"content": []}),
        sse("b").replace(b'"id":"x"', b'"id":"y"'),  # another chunk's bytes: parsed in full
        sse("b").replace(b'"b"', b'"b","role":"assistant"'),  # more than one string
        sse("b").replace(b'"b"', b'"\\ud800"'),  # a lone surrogate: not text
        sse("b").replace(b'"b"', b"7"),  # not a string
    ]:
        assert template.token(other, 0) is None, other
    second = sse("b").replace(b'"index":0', b'"index":1')
    assert (_Template.learned(second, Token(1, 0, "b", (), None)) or template).choice == 1
    ascii_escaped = b"data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": "é"}}]}).encode()
    assert _Template.learned(ascii_escaped, Token(0, 0, "é", (), None)) is None  # not orjson's bytes


# --- a worker's frames (``AttemptFrames``) ---------------------------------------------------

WORKER_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\ntransfer-encoding: chunked\r\n\r\n"


def frame(**fields: object) -> bytes:
    return orjson.dumps(fields) + b"\n"


def token_frame(text: str, index: int) -> bytes:
    return frame(type="token", choice=0, index=index, text=text, token_ids=[index])


WORKER_END = chunk(frame(type="done", finish_reason="stop", finish_reasons=["stop"], usage={})) + b"0\r\n\r\n"


async def worker_frames(server: Stepped, connections: Connections) -> AttemptFrames:
    server.parts.put_nowait(WORKER_HEAD + chunk(token_frame("a", 0)))
    answer = await connections.post(b"/v1/attempts", b"", b"{}")
    return AttemptFrames(answer.body, "w1")


async def test_a_workers_token_frames_that_come_while_the_frames_wait_are_taken_in_the_read() -> None:
    server = Stepped()
    async with server as connections:
        frames = await worker_frames(server, connections)
        reading = Reading(frames)
        await send(server, chunk(token_frame("b", 1)))
        await send(server, chunk(frame(type="heartbeat", phase="decode", queue_position=0)))  # not a token
        await send(server, chunk(token_frame("c", 2) + token_frame("d", 3)))
        call = frame(type="tool_call", choice=0, index=0, id="t", name="f", arguments="")
        await send(server, chunk(token_frame("e", 4) + call))
        await send(server, WORKER_END)
        await asyncio.wait_for(reading.task, 5)
    assert reading.offered == [["b"], ["c", "d"]]
    assert [(t.text, t.index, t.token_ids) for t in reading.taken] == [("b", 1, [1]), ("c", 2, [2]), ("d", 3, [3])]
    assert reading.yielded_texts() == ["a", "e"]  # the first, and the one read with a tool call
    assert [type(f).__name__ for f in reading.yielded] == ["Token", "Heartbeat", "Token", "ToolCallFrame", "Done"]


async def test_a_workers_token_frames_declined_are_returned_in_order() -> None:
    server = Stepped()
    async with server as connections:
        frames = await worker_frames(server, connections)
        reading = Reading(frames, accept=[False, True])
        await send(server, chunk(token_frame("b", 1)))
        await send(server, chunk(token_frame("c", 2)))
        await send(server, chunk(token_frame("d", 3))[:9])  # part of a line: read by the frames
        await send(server, chunk(token_frame("d", 3))[9:] + WORKER_END)
        await asyncio.wait_for(reading.task, 5)
    assert reading.offered == [["b"], ["c"]]
    assert reading.yielded_texts() == ["a", "b", "d"] and [t.text for t in reading.taken] == ["c"]


async def test_a_workers_token_frame_counts_the_token_ids_it_names_none_when_a_parser_split_it_off() -> None:
    """One engine output a reasoning parser split in two is two frames, the token ids in the
    first (docs/worker-protocol.md): the second is no token of its own, whether it is read
    by the frames or taken as it arrives."""
    server = Stepped()
    async with server as connections:
        frames = await worker_frames(server, connections)
        reading = Reading(frames, accept=[True, False])
        split = frame(type="token", choice=0, index=1, text="</th", token_ids=[7, 8], key="reasoning")
        await send(server, chunk(split + frame(type="token", choice=0, index=2, text="ink>Hi", token_ids=[])))
        await send(server, chunk(frame(type="token", choice=0, index=3, text=" you", token_ids=[])))
        await send(server, chunk(frame(type="token", choice=0, index=4, text="!", token_ids=[9, 10, 11])))
        await send(server, WORKER_END)
        await asyncio.wait_for(reading.task, 5)
    tokens = [token for token in [*reading.yielded, *reading.taken] if isinstance(token, Token)]
    by_text = {token.text: delta_of(token, with_ids=False).tokens for token in tokens}
    assert by_text == {"a": 1, "</th": 2, "ink>Hi": 0, " you": 0, "!": 3}
