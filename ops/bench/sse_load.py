"""A lean streaming client for the benches: HTTP/1.1 keep-alive over asyncio streams.

The load generator shares the cores with what it measures, so it parses only what it
times: the status line, the headers it needs, chunked framing, and in each SSE event
whether it carries content (a token) or an error. Every path of a run, direct or
through a gateway, is read by this same code.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

from ops.bench.measure import Sample, error_code, record

TOKEN = re.compile(rb'"content": ?"(?!")')


class ChatClient:
    """One client's connection to ``host:port``, reopened when the server closed it."""

    def __init__(self, host: str, port: int, model: str, tokens: int, api_key: str = "bench") -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.tokens = tokens
        self.model = model
        self.api_key = api_key

    def request(self, n: int) -> bytes:
        body = json.dumps(
            {
                "model": self.model,
                "messages": [{"role": "user", "content": f"bench {n}"}],
                "stream": True,
                "max_tokens": self.tokens,
            }
        ).encode()
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: {self.host}:{self.port}\r\n"
            f"content-type: application/json\r\nauthorization: Bearer {self.api_key}\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        )
        return head.encode() + body

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.reader = self.writer = None

    async def chat(self, n: int, sample: Sample, keep: bool) -> None:
        """One streamed chat: its tokens into ``sample`` (times kept when ``keep``)."""
        try:
            if self.writer is None:
                self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
            assert self.reader is not None
            began, last = time.perf_counter(), None
            self.writer.write(self.request(n))
            status = await self.reader.readline()
            chunked, length, closing = False, 0, False
            while (line := await self.reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                name, value = name.strip().lower(), value.strip().lower()
                chunked |= name == "transfer-encoding" and "chunked" in value
                length = int(value) if name == "content-length" else length
                closing |= name == "connection" and value == "close"
            if not chunked:
                body = await self.reader.readexactly(length)
                raise RuntimeError(f"not a stream: HTTP {status.split(b' ', 2)[1].decode()} {error_code(body)}")
            error = "" if status.split(b" ", 2)[1] == b"200" else f"HTTP {status.split(b' ', 2)[1].decode()}"
            done, rest = False, b""
            while size := int((await self.reader.readline()).split(b";")[0], 16):
                rest += (await self.reader.readexactly(size + 2))[:-2]
                *events, rest = rest.split(b"\n\n")
                for event in events:
                    if event.startswith(b'data: {"error"'):
                        error = f"error event {error_code(event[6:])}"
                    elif event == b"data: [DONE]":
                        done = True
                    elif TOKEN.search(event):
                        last = record(sample, began, last, keep)
            await self.reader.readline()  # the empty trailer
            if closing:
                await self.close()
            if error or not done:
                raise RuntimeError(error or "no [DONE]")
            sample.requests += 1
        except (OSError, RuntimeError, ValueError, asyncio.IncompleteReadError) as exc:
            sample.failed(str(exc) if isinstance(exc, RuntimeError) else type(exc).__name__)
            await self.close()
