"""The churn soak's clients (ops/churn.py): mixed traffic, each request kept as the client saw it.

Five kinds, picked at random by each client in turn, all through the real HTTP API:

    chat_stream    a streamed chat completion, read to its end
    chat_whole     a chat completion answered whole (``stream`` false)
    tool_call      a streamed chat with a tool the model must call
    responses_bg   a background Responses request, then polled until it ends
    resume         a streamed chat the client drops after a few deltas, then resumes with
                   ``Last-Event-ID`` (docs/design.md §12), on any gateway

Each yields a :class:`Record`: what the client received, as one :class:`Transcript` (a resume's
two halves joined in order, their SSE ids kept as received, so a repeat or a gap shows), or, for
an answer read whole, its text, tool calls and status. ``ops/churn_check.py`` judges it against
the request's log.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from ops.transcript import Transcript

MODEL = "sim"
KINDS = ("chat_stream", "chat_whole", "tool_call", "responses_bg", "resume")
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
TERMINAL_STATUSES = {"completed", "failed", "cancelled", "incomplete"}


@dataclass
class Record:
    kind: str
    transcript: Transcript  # streamed kinds: every line; whole kinds: request id, status, error
    whole: dict[str, Any] | None = None  # whole kinds: the answer's text, tool calls, status
    resumed: bool = False  # resume: the second half was read
    gave_up: bool = False  # resume: no gateway resumed it to its end within a minute
    notes: list[str] = field(default_factory=list)


async def clients(gateway_urls: list[str], count: int, seconds: float, rng: random.Random) -> list[Record]:
    """``count`` clients, spread over the gateways, each sending requests back to back."""
    records: list[Record] = []
    deadline = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=count)
    async with httpx.AsyncClient(timeout=120.0, limits=limits) as http:

        async def client(n: int) -> None:
            await asyncio.sleep(rng.uniform(0, 1.0))
            while time.monotonic() < deadline:
                kind = rng.choice(KINDS)
                url = gateway_urls[(n + len(records)) % len(gateway_urls)]
                record = await SEND[kind](http, url, gateway_urls, f"churn {n} {rng.random()}", rng)
                records.append(record)
                if record.transcript.status == 0 or record.transcript.status >= 500:
                    await asyncio.sleep(0.3)  # its gateway (or the database) is down: a moment

        await asyncio.gather(*(client(n) for n in range(count)))
    return records


def _chat(prompt: str, rng: random.Random, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": prompt}]
    return {"model": MODEL, "messages": messages, "max_tokens": rng.randint(5, 60), **extra}


async def _stream(
    http: httpx.AsyncClient, method: str, url: str, transcript: Transcript, stop_after: int | None = None, **kw: Any
) -> bool:
    """Read one SSE answer into ``transcript``; ``True`` when it hung up after ``stop_after`` deltas."""
    try:
        async with http.stream(method, url, **kw) as response:
            transcript.request_id = transcript.request_id or response.headers.get("x-request-id", "")
            transcript.status = response.status_code
            if response.status_code != 200:
                transcript.error = _error_of(await response.aread())
                return False
            async for line in response.aiter_lines():
                if transcript.read(line) and stop_after is not None and len(transcript.contents) >= stop_after:
                    return True  # leaving the block closes the connection: the client is gone
    except httpx.HTTPError as exc:
        if not transcript.request_id:
            transcript.error = {"code": "client_error", "message": repr(exc)}
        else:
            transcript.cut = True  # mid-stream: its gateway died under it
    return False


def _error_of(body: bytes) -> dict[str, Any]:
    with contextlib.suppress(ValueError, AttributeError):
        return dict(json.loads(body)["error"])
    return {"code": "unreadable", "message": body[:200].decode(errors="replace")}


async def chat_stream(http: httpx.AsyncClient, url: str, _: list[str], prompt: str, rng: random.Random) -> Record:
    transcript = Transcript("", 0)
    await _stream(http, "POST", url + "/v1/chat/completions", transcript, json=_chat(prompt, rng, stream=True))
    return Record("chat_stream", transcript)


async def tool_call(http: httpx.AsyncClient, url: str, _: list[str], prompt: str, rng: random.Random) -> Record:
    transcript = Transcript("", 0)
    body = _chat(prompt, rng, stream=True, tools=TOOLS, tool_choice="required")
    await _stream(http, "POST", url + "/v1/chat/completions", transcript, json=body)
    return Record("tool_call", transcript)


async def chat_whole(http: httpx.AsyncClient, url: str, _: list[str], prompt: str, rng: random.Random) -> Record:
    transcript = Transcript("", 0)
    record = Record("chat_whole", transcript)
    try:
        response = await http.post(url + "/v1/chat/completions", json=_chat(prompt, rng))
    except httpx.HTTPError as exc:
        transcript.error = {"code": "client_error", "message": repr(exc)}
        return record
    transcript.request_id, transcript.status = response.headers.get("x-request-id", ""), response.status_code
    if response.status_code != 200:
        transcript.error = _error_of(response.content)
        return record
    (choice,) = response.json()["choices"]
    message = choice["message"]
    record.whole = {
        "text": (message.get("reasoning_content") or "") + (message.get("content") or ""),
        "tool_calls": message.get("tool_calls") or [],
        "status": "completed",
        "finish_reason": choice.get("finish_reason"),
    }
    return record


async def responses_bg(http: httpx.AsyncClient, url: str, urls: list[str], prompt: str, rng: random.Random) -> Record:
    """A background response, polled (through any gateway) until it ends."""
    transcript = Transcript("", 0)
    record = Record("responses_bg", transcript)
    body = {"model": MODEL, "input": prompt, "background": True, "max_output_tokens": rng.randint(5, 60)}
    try:
        response = await http.post(url + "/v1/responses", json=body)
    except httpx.HTTPError as exc:
        transcript.error = {"code": "client_error", "message": repr(exc)}
        return record
    transcript.status = response.status_code
    if response.status_code != 200:
        transcript.request_id = response.headers.get("x-request-id", "")
        transcript.error = _error_of(response.content)
        return record
    answer = response.json()
    transcript.request_id = "req_" + answer["id"].removeprefix("resp_")
    deadline = time.monotonic() + 120.0
    while answer.get("status") not in TERMINAL_STATUSES and time.monotonic() < deadline:
        await asyncio.sleep(0.25)
        try:
            polled = await http.get(rng.choice(urls) + f"/v1/responses/{answer['id']}")
            if polled.status_code == 200:
                answer = polled.json()
            else:
                record.notes.append(f"poll {polled.status_code} {polled.text[:120]}")
        except (httpx.HTTPError, ValueError) as exc:
            record.notes.append(f"poll failed: {exc!r}")
    record.whole = {"text": _output_text(answer), "status": answer.get("status"), "error": answer.get("error")}
    if answer.get("error"):
        transcript.error = answer["error"]
    return record


def _output_text(answer: dict[str, Any]) -> str:
    return "".join(
        part.get("text", "")
        for item in answer.get("output") or []
        for part in item.get("content") or []
        if part.get("type") in ("output_text", "reasoning_text")
    )


async def resume(http: httpx.AsyncClient, url: str, urls: list[str], prompt: str, rng: random.Random) -> Record:
    """Drop a stream after a few deltas, resume it with ``Last-Event-ID`` on a random gateway."""
    transcript = Transcript("", 0)
    record = Record("resume", transcript)
    body = _chat(prompt, rng, stream=True, max_tokens=rng.randint(20, 60))
    left = await _stream(http, "POST", url + "/v1/chat/completions", transcript, rng.randint(1, 4), json=body)
    if not (left or transcript.cut):
        return record  # it ended (or was refused) before the client left: a plain stream
    transcript.cut = False
    last = transcript.event_ids[-1] if transcript.event_ids else None
    headers = {"last-event-id": str(last)} if last is not None else {}
    deadline = time.monotonic() + 60.0
    while time.monotonic() < deadline:
        before = len(transcript.contents)
        status = await _resume_once(http, rng.choice(urls), transcript, headers)
        if status == 200 and not transcript.cut:
            record.resumed = True
            return record
        if transcript.cut and len(transcript.contents) > before:
            last = transcript.event_ids[-1]
            headers = {"last-event-id": str(last)}
        transcript.cut = False
        record.notes.append(f"resume answered {status}")
        await asyncio.sleep(0.5)  # its gateway is down, or the database: again, anywhere
    record.gave_up = True
    return record


async def _resume_once(http: httpx.AsyncClient, url: str, transcript: Transcript, headers: dict[str, str]) -> int:
    request_id = transcript.request_id
    half = Transcript(request_id, 0)
    await _stream(http, "GET", url + f"/v1/requests/{request_id}/stream", half, headers=headers)
    if half.status == 200:
        transcript.event_ids += half.event_ids
        transcript.contents += half.contents
        transcript.kinds += half.kinds
        transcript.tool_calls += half.tool_calls
        transcript.error, transcript.done = half.error, half.done
        transcript.finish_reason = half.finish_reason or transcript.finish_reason
        transcript.cut = half.cut
    return half.status


SEND = {
    "chat_stream": chat_stream,
    "chat_whole": chat_whole,
    "tool_call": tool_call,
    "responses_bg": responses_bg,
    "resume": resume,
}
