"""How an OpenAI upstream's SSE body is cut into lines and frames, whatever its reads hold."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import orjson
import pytest

from app.replicas.base import Done, Frame, Token
from app.replicas.body_reads import HttpxBody
from app.replicas.openai_stream import OpenAIStream


def event(text: str | None = None, finish: str | None = None, usage: bool = False) -> bytes:
    choice = {"index": 0, "delta": {} if text is None else {"content": text}, "finish_reason": finish}
    chunk: dict[str, object] = {"id": "x", "object": "chat.completion.chunk", "choices": [choice]}
    if usage:
        chunk = {"id": "x", "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}}
    return b"data: " + orjson.dumps(chunk) + b"\n\n"  # orjson leaves U+2028 and U+0085 as they are


async def frames_of(reads: list[bytes]) -> list[Frame]:
    async def body() -> AsyncIterator[bytes]:
        for read in reads:
            yield read

    stream = OpenAIStream(HttpxBody(httpx.Response(200, content=body())), choices=1)
    return [frame async for frame in stream.frames()]


def texts(frames: list[Frame]) -> list[str]:
    return [frame.text for frame in frames if isinstance(frame, Token)]


WHOLE = event("a\u2028b") + event("c\u0085d\x0be") + event(finish="stop") + event(usage=True) + b"data: [DONE]\n\n"


async def test_unicode_line_separators_inside_the_json_are_text_not_line_ends() -> None:
    frames = await frames_of([WHOLE])
    assert texts(frames) == ["a\u2028b", "c\u0085d\x0be"]
    assert isinstance(frames[-1], Done) and frames[-1].usage["total_tokens"] == 3


@pytest.mark.parametrize("size", [1, 2, 3, 7, 50])
@pytest.mark.parametrize("line_end", [b"\n", b"\r\n", b"\r"])
async def test_lines_cut_anywhere_by_the_reads_and_any_line_end(size: int, line_end: bytes) -> None:
    body = WHOLE.replace(b"\n", line_end)
    frames = await frames_of([body[at : at + size] for at in range(0, len(body), size)])
    assert texts(frames) == ["a\u2028b", "c\u0085d\x0be"]
    assert isinstance(frames[-1], Done) and frames[-1].finish_reasons == ["stop"]


async def test_a_last_line_without_its_line_break_is_read() -> None:
    frames = await frames_of([event("x"), event(finish="stop").rstrip(b"\n")])
    assert texts(frames) == ["x"]
    assert isinstance(frames[-1], Done)
