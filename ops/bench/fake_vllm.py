"""A fake vLLM OpenAI server for benchmarks: vLLM's exact streaming chunks, on a fixed schedule.

    python -m ops.bench.fake_vllm --port P [--ttft-ms 20] [--token-ms 5]

Every chat completion streams ``max_tokens`` tokens (32 when unset): the first after
``ttft-ms``, then one every ``token-ms``, each on its deadline from the request's
arrival (no drift). The bytes are those of vLLM's ``/v1/chat/completions`` (pydantic's
compact JSON, unset fields left out): a first chunk with ``role`` and empty content
together with the first token, one chunk per token, ``finish_reason`` and
``stop_reason`` on the last token's chunk, a usage chunk with no choices when
``stream_options.include_usage`` asks for it, then ``data: [DONE]``, each SSE event in
its own HTTP chunk. ``/v1/completions`` (the gateways' health probes) answers whole,
``/health`` and ``/v1/models`` as vLLM does.

It is a raw asyncio protocol with pre-encoded templates rather than an ASGI app, so
that at 100 streams the upstream is not what saturates the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from typing import Any

WORD = b" tok"
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
    b"transfer-encoding: chunked\r\nconnection: keep-alive\r\n\r\n"
)


def _chunk(payload: bytes) -> bytes:
    """One HTTP chunk holding one SSE event."""
    event = b"data: " + payload + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(event), event)


def _json_response(status: str, body: dict[str, Any]) -> bytes:
    data = json.dumps(body, separators=(",", ":")).encode()
    head = f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(data)}\r\n\r\n"
    return head.encode() + data


class Stream:
    """The chunks of one streamed chat completion, built from templates."""

    def __init__(self, model: str, tokens: int, prompt_tokens: int, usage: bool) -> None:
        head = b'{"id":"chatcmpl-%s","object":"chat.completion.chunk","created":%d,"model":%s,"choices":[' % (
            uuid.uuid4().hex.encode(),
            int(time.time()),
            json.dumps(model).encode(),
        )
        self.first = _chunk(
            head + b'{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}'
        )
        self.token = _chunk(
            head + b'{"index":0,"delta":{"content":"' + WORD + b'"},"logprobs":null,"finish_reason":null}]}'
        )
        self.last = _chunk(
            head
            + b'{"index":0,"delta":{"content":"'
            + WORD
            + b'"},"logprobs":null,"finish_reason":"length","stop_reason":null}]}'
        )
        self.usage = (
            _chunk(
                head
                + b'],"usage":{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d}}'
                % (prompt_tokens, prompt_tokens + tokens, tokens)
            )
            if usage
            else b""
        )
        self.tokens = tokens


class FakeVllm(asyncio.Protocol):
    def __init__(self, model: str, ttft_s: float, token_s: float) -> None:
        self.model, self.ttft_s, self.token_s = model, ttft_s, token_s
        self.buffer = b""
        self.transport: asyncio.Transport | None = None
        self.busy = False
        self.queue: asyncio.Queue[tuple[bytes, bytes]] = asyncio.Queue()
        self.task: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.task = asyncio.get_running_loop().create_task(self.serve())

    def connection_lost(self, exc: Exception | None) -> None:
        if self.task is not None:
            self.task.cancel()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buffer[:end].decode("latin-1")
            length = 0
            for line in head.split("\r\n")[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            if len(self.buffer) < end + 4 + length:
                return
            body = self.buffer[end + 4 : end + 4 + length]
            self.buffer = self.buffer[end + 4 + length :]
            self.queue.put_nowait((head.split(" ", 2)[1].encode(), body))

    async def serve(self) -> None:
        """Answer this connection's requests in order (HTTP/1.1 keep-alive)."""
        while True:
            path, body = await self.queue.get()
            assert self.transport is not None
            if path.endswith(b"/chat/completions"):
                await self.chat(json.loads(body))
            elif path.endswith(b"/completions"):
                self.transport.write(self.completion(json.loads(body)))
            elif path.endswith(b"/models"):
                self.transport.write(
                    _json_response("200 OK", {"object": "list", "data": [{"id": self.model, "object": "model"}]})
                )
            elif path.endswith(b"/health"):
                self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            else:
                self.transport.write(_json_response("404 Not Found", {"error": {"message": "not found"}}))

    def completion(self, body: dict[str, Any]) -> bytes:
        tokens = int(body.get("max_tokens") or 16)
        text = (WORD * tokens).decode()
        return _json_response(
            "200 OK",
            {
                "id": f"cmpl-{uuid.uuid4().hex}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": self.model,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}],
                "usage": {"prompt_tokens": 1, "total_tokens": 1 + tokens, "completion_tokens": tokens},
            },
        )

    async def chat(self, body: dict[str, Any]) -> None:
        assert self.transport is not None
        began = time.monotonic()
        tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 32)
        prompt = sum(len(str(m.get("content", ""))) for m in body.get("messages", [])) // 4 + 1
        if not body.get("stream"):
            usage_body = {"prompt_tokens": prompt, "total_tokens": prompt + tokens, "completion_tokens": tokens}
            await asyncio.sleep(self.ttft_s + self.token_s * (tokens - 1))
            text = (WORD * tokens).decode()
            self.transport.write(
                _json_response(
                    "200 OK",
                    {
                        "id": f"chatcmpl-{uuid.uuid4().hex}",
                        "object": "chat.completion",
                        "created": int(time.time()),
                        "model": self.model,
                        "choices": [
                            {
                                "index": 0,
                                "message": {"role": "assistant", "content": text},
                                "logprobs": None,
                                "finish_reason": "length",
                                "stop_reason": None,
                            }
                        ],
                        "usage": usage_body,
                    },
                )
            )
            return
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        stream = Stream(str(body.get("model", self.model)), tokens, prompt, usage)
        self.transport.write(SSE_HEAD)
        for index in range(tokens):
            delay = began + self.ttft_s + index * self.token_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if self.transport.is_closing():
                return
            chunk = stream.last if index == tokens - 1 else stream.token
            self.transport.write(stream.first + chunk if index == 0 else chunk)
        self.transport.write(stream.usage + _chunk(b"[DONE]") + b"0\r\n\r\n")


def command(port: int, model: str, *, ttft_ms: float = 20.0, token_ms: float = 5.0) -> list[str]:
    """The command that runs this upstream on ``port`` (from the repository's root)."""
    return [
        sys.executable,
        "-m",
        "ops.bench.fake_vllm",
        "--port",
        str(port),
        "--model",
        model,
        "--ttft-ms",
        str(ttft_ms),
        "--token-ms",
        str(token_ms),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="m")
    parser.add_argument("--ttft-ms", type=float, default=20.0)
    parser.add_argument("--token-ms", type=float, default=5.0)
    options = parser.parse_args()

    async def run() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            lambda: FakeVllm(options.model, options.ttft_ms / 1000, options.token_ms / 1000),
            options.host,
            options.port,
            backlog=4096,
        )
        async with server:
            await server.serve_forever()

    asyncio.run(run())


if __name__ == "__main__":
    main()
