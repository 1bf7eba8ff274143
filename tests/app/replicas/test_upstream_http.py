"""The lean HTTP/1.1 connections for an OpenAI upstream's streamed answers
(``app/replicas/upstream_http.py``), against a small server in the test's loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
import pytest

from app.replicas.chunked import Chunks
from app.replicas.upstream_http import Answer, Body, Connections, lean_connections

PATIENT_S = 30.0
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class Server:
    """Answers each request with ``answer(n)`` (the n-th request), counting connections."""

    def __init__(self, answer: Callable[[int], list[bytes]], close_after: bool = False) -> None:
        self.answer = answer
        self.close_after = close_after
        self.connections = 0
        self.requests: list[bytes] = []
        self.server: asyncio.Server | None = None
        self.writers: list[asyncio.StreamWriter] = []

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                self.requests.append(head + await reader.readexactly(length))
                for part in self.answer(len(self.requests)):
                    writer.write(part)
                    await writer.drain()
                if self.close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def __aenter__(self) -> Connections:
        self.server = await asyncio.start_server(self.serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        # a loaded machine's connect can take seconds (CI); no test here is about its deadline
        return Connections("127.0.0.1", port, connect_timeout_s=PATIENT_S)

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        for writer in self.writers:
            writer.close()
        await asyncio.sleep(0.01)  # the handlers see their connections closed and end


async def post(connections: Connections, body: bytes = b'{"n":1}') -> Answer:
    return await connections.post(b"/v1/chat/completions", b"content-type: application/json\r\n", body)


async def reads_of(body: Body) -> list[bytes]:
    reads = []
    while read := await body.read():
        reads.append(read)
    return reads


async def body_of(answer: Answer) -> bytes:
    return b"".join(await reads_of(answer.body))


def whole(n: int) -> list[bytes]:
    return [HEAD + chunk(b"data: a\n\n"), chunk(b"data: b\n\n") + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"]


async def test_a_body_read_to_its_end_leaves_its_connection_for_the_next_request() -> None:
    server = Server(whole)
    async with server as connections:
        for _ in range(3):
            response = await post(connections)
            assert response.status_code == 200
            assert await body_of(response) == b"data: a\n\ndata: b\n\ndata: [DONE]\n\n"
            await response.body.aclose()
        connections.close()
    assert server.connections == 1 and len(server.requests) == 3
    assert server.requests[0].endswith(b'\r\n\r\n{"n":1}') and b"content-length: 7" in server.requests[0].lower()


async def test_chunks_that_came_in_one_read_are_one_body_read() -> None:
    async with Server(lambda n: [HEAD + chunk(b"1") + chunk(b"2") + chunk(b"3") + b"0\r\n\r\n"]) as connections:
        response = await post(connections)
        assert await reads_of(response.body) == [b"123"]
        await response.body.aclose()
        connections.close()


async def test_a_body_closed_before_its_end_closes_its_connection() -> None:
    server = Server(lambda n: [HEAD + chunk(b"data: a\n\n")] if n == 1 else whole(n))
    async with server as connections:
        response = await post(connections)
        assert await response.body.read() == b"data: a\n\n"
        await response.body.aclose()  # a cancel: closing is how the upstream learns of it
        response = await post(connections)
        assert await body_of(response) == b"data: a\n\ndata: b\n\ndata: [DONE]\n\n"
        await response.body.aclose()
        connections.close()
    assert server.connections == 2


async def test_a_connection_its_server_closed_while_idle_is_not_used_again() -> None:
    server = Server(whole, close_after=True)
    async with server as connections:
        for _ in range(2):
            response = await post(connections)
            await body_of(response)
            await response.body.aclose()
            await asyncio.sleep(0.05)  # the server's close arrives
        connections.close()
    assert server.connections == 2 and len(server.requests) == 2


async def test_a_body_cut_midway_is_a_transport_error() -> None:
    async with Server(lambda n: [HEAD + chunk(b"data: a\n\n")], close_after=True) as connections:
        response = await post(connections)
        with pytest.raises(httpx.TransportError):
            await body_of(response)
        await response.body.aclose()
        connections.close()


async def test_a_refused_connection_is_a_connect_error() -> None:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    connections = Connections("127.0.0.1", port, connect_timeout_s=PATIENT_S)
    with pytest.raises(httpx.ConnectError):
        await post(connections)


def test_only_plain_http_without_a_proxy_comes_here(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY", "no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    assert lean_connections("http://vllm:8000", connect_timeout_s=1.0) is not None
    assert lean_connections("https://vllm:8000", connect_timeout_s=1.0) is None
    monkeypatch.setenv("HTTP_PROXY", "http://proxy:3128")
    assert lean_connections("http://vllm:8000", connect_timeout_s=1.0) is None
    monkeypatch.setenv("NO_PROXY", "vllm")
    assert lean_connections("http://vllm:8000", connect_timeout_s=1.0) is not None


BODY = b"data: a\n\n" * 3 + b"data: [DONE]\n\n"
FRAMED = (  # a chunk extension, and a trailer
    b"9\r\ndata: a\n\n\r\n9;ext=1\r\ndata: a\n\n\r\n9\r\ndata: a\n\n\r\n"
    b"e\r\ndata: [DONE]\n\n\r\n0\r\nx-trailer: 1\r\n\r\n"
)


async def bodies_of_two_posts(server: Server) -> list[bytes]:
    """Two requests one after the other, each body read to its end (so its connection may be kept)."""
    bodies = []
    async with server as connections:
        for _ in range(2):
            response = await post(connections)
            bodies.append(await body_of(response))
            await response.body.aclose()
        connections.close()
    return bodies


@pytest.mark.parametrize("size", [1, 2, 5, 13, 1000])
async def test_chunk_framing_cut_anywhere_by_the_reads(size: int) -> None:
    answer = HEAD + FRAMED
    parts = [answer[at : at + size] for at in range(0, len(answer), size)]
    server = Server(lambda n: parts)  # each part its own write
    assert await bodies_of_two_posts(server) == [BODY, BODY]
    assert server.connections == 1


async def test_an_answer_that_says_connection_close_is_not_kept() -> None:
    head = HEAD.replace(b"\r\n\r\n", b"\r\nconnection: close\r\n\r\n")
    server = Server(lambda n: [head + FRAMED])
    assert await bodies_of_two_posts(server) == [BODY, BODY]
    assert server.connections == 2


@pytest.mark.parametrize("size", [1, 2, 3, 7, 11])
def test_the_chunk_framing_taken_off_whatever_the_reads_bring(size: int) -> None:
    chunks, data = Chunks(b""), b""
    for at in range(0, len(FRAMED), size):
        assert not chunks.done
        chunks.buffer += FRAMED[at : at + size]
        data += b"".join(chunks.decode())
    assert chunks.done and data == BODY and not chunks.buffer


@pytest.mark.parametrize("framed", [b"zz\r\n", b"3\r\nabcXY", b"-1\r\n"])
def test_broken_chunk_framing_is_a_protocol_error(framed: bytes) -> None:
    with pytest.raises(httpx.RemoteProtocolError):
        Chunks(framed).decode()


async def test_a_request_is_one_write_with_its_host_and_length() -> None:
    server = Server(whole)
    async with server as connections:
        response = await post(connections)
        await body_of(response)
        await response.body.aclose()
        connections.close()
    head = server.requests[0].split(b"\r\n\r\n")[0].split(b"\r\n")
    assert head[0] == b"POST /v1/chat/completions HTTP/1.1"
    assert f"host: 127.0.0.1:{connections.port}".encode() in head and b"content-length: 7" in head


async def test_a_body_of_a_given_length_keeps_its_connection() -> None:
    answer = b'HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: 9\r\n\r\n{"a": 1 }'
    parts = [answer[:30], answer[30:90], answer[90:]]
    server = Server(lambda n: parts)
    async with server as connections:
        for _ in range(2):
            response = await post(connections)
            assert (response.status_code, response.reason_phrase) == (400, "Bad Request")
            assert response.headers["content-type"] == "application/json"
            assert await body_of(response) == b'{"a": 1 }'
            await response.body.aclose()
        connections.close()
    assert server.connections == 1


async def test_a_body_without_length_or_chunks_lasts_until_the_close_and_informational_answers_are_skipped() -> None:
    answer = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nX-A: 1\r\nx-a: 2\r\n\r\ndata: a\n\n"
    server = Server(lambda n: [answer], close_after=True)
    async with server as connections:
        response = await post(connections)
        assert response.status_code == 200 and response.headers["x-a"] == "1, 2"
        assert await body_of(response) == b"data: a\n\n"
        await response.body.aclose()
        connections.close()


@pytest.mark.parametrize(
    "head", [b"HTTP/1.1 2000 OK\r\n\r\n", b"SPDY 200 OK\r\n\r\n", b"HTTP/1.1 200 OK\r\nno colon\r\n\r\n"]
)
async def test_a_malformed_head_is_a_protocol_error(head: bytes) -> None:
    async with Server(lambda n: [head], close_after=True) as connections:
        with pytest.raises(httpx.RemoteProtocolError):
            await post(connections)
        connections.close()
