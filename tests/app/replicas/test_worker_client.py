"""The worker client's error mapping and frame parsing, over real sockets.

What a real worker does is covered in tests/app/worker; here a few raw socket peers
produce what a worker never should (a frame split across reads, a reset, a cut frame)
so that each lands on the right typed error, on both ways a start goes: the lean
connections (a plain ``http://`` worker) and httpx (here through a proxy from the
environment, which the raw peer plays too: it answers whatever comes).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

import pytest

from app.replicas.base import Done, Frame, Token
from app.replicas.worker_client import WorkerClient
from app.replicas.worker_errors import (
    AttemptEnded,
    ConnectFailed,
    ConnectTimedOut,
    MalformedFrame,
    ReadStalled,
    Rejected,
    ReplicaExiting,
    RequestRefused,
    StreamBroken,
    TokenRefused,
    WorkerError,
)
from statemachine.events import FailureKind
from tests.support.streams import collect
from tests.support.workers import free_port

E = TypeVar("E", bound=WorkerError)

START = {"request_id": "r", "attempt": 1, "lease_epoch": 1, "lease_ttl_s": 5.0, "model": "sim", "prompt": "x"}


STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\ntransfer-encoding: chunked\r\n\r\n"


class Peer:
    """What a scripted peer saw: its connections and the heads of the requests it read."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.connections = 0
        self.heads: list[bytes] = []


@contextlib.asynccontextmanager
async def scripted_peer(
    pieces: Sequence[bytes],
    *,
    reset: bool = False,
    gap_s: float = 0.01,
    head: bytes | None = STREAM_HEAD,
    keep_alive: bool = False,
) -> AsyncIterator[Peer]:
    """An HTTP/1.1 peer that answers any request with ``head`` (none: it never answers) and
    a chunked body made of ``pieces`` (one chunk each, ``gap_s`` apart), and then closes,
    resets the connection, or (``keep_alive``) reads the connection's next request."""

    handlers: list[asyncio.Task[None]] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handlers.append(asyncio.current_task())  # type: ignore[arg-type]
        peer.connections += 1
        try:
            while await answer(reader, writer) and keep_alive:
                pass
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client closed the connection
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        request_head = await reader.readuntil(b"\r\n\r\n")
        peer.heads.append(request_head)
        length = next(
            (
                int(line.split(b":")[1])
                for line in request_head.split(b"\r\n")
                if line.lower().startswith(b"content-length")
            ),
            0,
        )
        await reader.readexactly(length)
        if head is None:
            await reader.read()  # until the client gives up
            return False
        writer.write(head)
        for piece in pieces:
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
            await asyncio.sleep(gap_s)
        if reset:
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return False
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    peer = Peer(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
    try:
        yield peer
    finally:
        server.close()
        for handler in handlers:
            handler.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        await server.wait_closed()


Connect = Callable[..., WorkerClient]


@pytest.fixture(params=["lean", "httpx"])
def connect(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Connect:
    """A client of a peer at ``url``: on the lean connections, or on httpx with the peer as its proxy."""
    for name in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY", "no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)

    def client_of(url: str, **options: Any) -> WorkerClient:
        if request.param == "lean":
            client = WorkerClient(url, **options)
        else:
            monkeypatch.setenv("HTTP_PROXY", url)
            client = WorkerClient("http://worker.invalid:8000", **options)
        assert client.lean_starts is (request.param == "lean")
        return client

    return client_of


async def run(
    connect: Connect, pieces: Sequence[bytes], *, reset: bool = False
) -> tuple[list[Frame], WorkerError | None]:
    async with scripted_peer(pieces, reset=reset) as peer:
        client = connect(peer.url)
        try:
            got = await collect(await client.start(**START))  # type: ignore[arg-type]
        finally:
            await client.aclose()
    return got.frames, got.error


async def failed_start(client: WorkerClient, expected: type[E]) -> E:
    """The ``expected`` error ``client``'s start raised; the client closed."""
    try:
        with pytest.raises(expected) as raised:
            await client.start(**START)  # type: ignore[arg-type]
    finally:
        await client.aclose()
    return raised.value


TOKEN = b'{"type":"token","choice":0,"index":%d,"text":" w%d","token_ids":[%d]}\n'
DONE = b'{"type":"done","finish_reason":"stop","finish_reasons":["stop"],"usage":{"completion_tokens":2}}\n'


async def test_frames_split_across_reads_and_packed_into_one(connect: Connect) -> None:
    body = TOKEN % (0, 0, 0) + TOKEN % (1, 1, 1) + DONE
    frames, error = await run(connect, [body[:10], body[10:50], body[50:51], body[51:]])
    assert error is None
    assert [type(f) for f in frames] == [Token, Token, Done]
    assert [f.text for f in frames if isinstance(f, Token)] == [" w0", " w1"]


async def test_a_choices_first_token_frame_says_what_vllm_says_of_the_prompt(connect: Connect) -> None:
    """Where the client asked (``return_token_ids``, ``return_prompt_text``), the worker's
    first token frame of a choice names the prompt's token ids and rendered text."""
    said = b'{"type":"token","choice":0,"index":0,"text":" w0","token_ids":[7],'
    said += b'"prompt_token_ids":[1,2],"prompt_text":null}\n'
    frames, error = await run(connect, [said + TOKEN % (1, 1, 1) + DONE])
    assert error is None
    assert [f.prompt for f in frames if isinstance(f, Token)] == [((1, 2), None), None]
    assert [list(f.token_ids) for f in frames if isinstance(f, Token)] == [[7], [1]]


async def test_an_end_without_done_is_a_broken_stream(connect: Connect) -> None:
    frames, error = await run(connect, [TOKEN % (0, 0, 0)])
    assert len(frames) == 1 and isinstance(error, StreamBroken)
    assert error.kind is FailureKind.REPLICA_EXITED and error.released


async def test_a_reset_is_a_broken_stream(connect: Connect) -> None:
    _, error = await run(connect, [TOKEN % (0, 0, 0)], reset=True)
    assert isinstance(error, StreamBroken) and error.kind is FailureKind.REPLICA_EXITED


async def test_an_end_inside_a_frame_is_malformed(connect: Connect) -> None:
    frames, error = await run(connect, [TOKEN % (0, 0, 0), b'{"type":"tok'])
    assert len(frames) == 1 and isinstance(error, MalformedFrame)
    assert error.kind is FailureKind.LIVENESS_UNCERTAIN and not error.released


@pytest.mark.parametrize(
    "line",
    [
        b"not json\n",
        b'{"type":"token","index":0}\n',
        b'{"type":"wormhole"}\n',
        b"[1]\n",
        b"\n",
        b'{"type":"token","choice":0,"index":1,"text":"a","token_ids":[1],"prompt_token_ids":"1 2"}\n',
        b'{"type":"token","choice":0,"index":1,"text":"a","token_ids":[1],"prompt_token_ids":null,"prompt_text":3}\n',
    ],
    ids=["not-json", "missing-keys", "unknown-type", "not-an-object", "empty-line", "prompt-ids", "prompt-text"],
)
async def test_a_line_that_is_not_a_frame_is_malformed(connect: Connect, line: bytes) -> None:
    frames, error = await run(connect, [TOKEN % (0, 0, 0), line, DONE])
    assert len(frames) == 1 and isinstance(error, MalformedFrame) and error.line == line.rstrip(b"\n")


async def test_error_frames_end_the_attempt(connect: Connect) -> None:
    frame = b'{"type":"error","code":"engine_error","message":"boom","generated_tokens":4}\n'
    _, error = await run(connect, [TOKEN % (0, 0, 0), frame])
    assert isinstance(error, AttemptEnded) and (error.code, error.generated_tokens) == ("engine_error", 4)
    assert error.kind is FailureKind.REPLICA_EXITED and error.released
    _, error = await run(connect, [b'{"type":"error","code":"replica_exiting","message":"bye"}\n'])
    assert isinstance(error, ReplicaExiting) and error.kind is FailureKind.REPLICA_EXITED


async def test_connection_refused(connect: Connect) -> None:
    client = connect(f"http://127.0.0.1:{free_port()}")
    try:
        with pytest.raises(ConnectFailed) as failed:
            await client.start(**START)  # type: ignore[arg-type]
        assert failed.value.kind is FailureKind.REPLICA_EXITED
        with pytest.raises(ConnectFailed):
            await client.cancel("r", 1, 1)
        assert not await client.ready()
    finally:
        await client.aclose()


async def test_a_connect_that_hangs_is_a_timeout_not_a_death(connect: Connect) -> None:
    # a listener whose accept queue is full drops new SYNs: the connect hangs, as in a partition
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    fillers = []
    port = listener.getsockname()[1]
    try:
        for _ in range(4):
            filler = socket.socket()
            filler.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                filler.connect(("127.0.0.1", port))
            fillers.append(filler)
        await asyncio.sleep(0.1)
        timed_out = await failed_start(connect(f"http://127.0.0.1:{port}", connect_timeout=0.3), ConnectTimedOut)
        assert timed_out.kind is FailureKind.LIVENESS_UNCERTAIN and not timed_out.released
    finally:
        for filler in fillers:
            filler.close()
        listener.close()


async def test_an_answer_or_a_frame_that_does_not_come_within_the_read_timeout_is_a_stall(connect: Connect) -> None:
    async with scripted_peer([], head=None) as peer:  # reads the start, never answers
        stalled = await failed_start(connect(peer.url, read_timeout=0.3), ReadStalled)
    assert stalled.kind is FailureKind.LIVENESS_UNCERTAIN and not stalled.released
    async with scripted_peer([TOKEN % (0, 0, 0)], gap_s=5.0) as peer:  # one frame, then silence
        client = connect(peer.url, read_timeout=0.3)
        try:
            got = await collect(await client.start(**START))  # type: ignore[arg-type]
        finally:
            await client.aclose()
    assert len(got.tokens) == 1 and isinstance(got.error, ReadStalled)


async def test_a_client_without_a_read_timeout_leaves_the_reads_to_its_caller(connect: Connect) -> None:
    # the gateway's: its stall timer bounds the reads, one timer an attempt, not one a read
    async with scripted_peer([TOKEN % (0, 0, 0), TOKEN % (1, 1, 1), DONE], gap_s=0.4, keep_alive=True) as peer:
        client = connect(peer.url, read_timeout=None)
        try:
            got = await collect(await client.start(**START))  # type: ignore[arg-type]
            stalled = await collect(await client.start(**START, read_timeout=0.1))  # type: ignore[arg-type]
        finally:
            await client.aclose()
    assert got.error is None and len(got.tokens) == 2 and got.done is not None
    assert isinstance(stalled.error, ReadStalled)  # a bound given with the start still holds


def refusal_head(status: bytes, *fields: bytes) -> bytes:
    return b"HTTP/1.1 %s\r\ncontent-type: application/json\r\n%stransfer-encoding: chunked\r\n\r\n" % (
        status,
        b"".join(field + b"\r\n" for field in fields),
    )


@pytest.mark.parametrize(
    ("head", "body", "expected", "fields"),
    [
        (
            refusal_head(b"429 Too Many Requests", b"retry-after: 2"),
            b'{"error":{"code":"queue_full","message":"full"}}',
            Rejected,
            {"status": 429, "code": "queue_full", "retry_after": 2.0, "message": "full"},
        ),
        (
            refusal_head(b"503 Service Unavailable"),
            b'{"error":{"code":"replica_exiting","message":"bye"}}',
            ReplicaExiting,
            {"status": 503, "code": "replica_exiting"},
        ),
        (
            refusal_head(b"401 Unauthorized"),
            b'{"error":{"code":"invalid_worker_token","message":"no"}}',
            TokenRefused,
            {"status": 401, "code": "invalid_worker_token"},
        ),
        (
            refusal_head(b"400 Bad Request"),
            b'{"error":{"code":"invalid_field","message":"params.top_k: too big","field":"params.top_k"}}',
            RequestRefused,
            {"status": 400, "param": "top_k", "message": "top_k: too big"},
        ),
        (
            refusal_head(b"502 Bad Gateway"),
            b"upstream gone",
            Rejected,
            {"status": 502, "code": None, "retry_after": None, "message": "upstream gone"},
        ),
    ],
    ids=["429", "503-exiting", "401", "400", "502-not-json"],
)
async def test_a_refusal_before_any_frame_is_its_typed_error(
    connect: Connect, head: bytes, body: bytes, expected: type[WorkerError], fields: dict[str, Any]
) -> None:
    async with scripted_peer([body], head=head) as peer:
        refused = await failed_start(connect(peer.url), expected)
    assert type(refused) is expected
    assert {name: getattr(refused, name) for name in fields} == fields


async def test_a_start_carries_the_token_and_its_answer_names_the_worker(connect: Connect) -> None:
    head = STREAM_HEAD.replace(b"\r\n\r\n", b"\r\nx-phasegate-worker: w-7\r\n\r\n")
    async with scripted_peer([DONE], head=head) as peer:
        client = connect(peer.url, token="s3cret")
        try:
            stream = await client.start(**START)  # type: ignore[arg-type]
            got = await collect(stream)
        finally:
            await client.aclose()
    assert stream.worker_id == "w-7" and got.done is not None
    (request,) = peer.heads
    assert b"\r\nauthorization: Bearer s3cret\r\n" in request and b"content-type: application/json" in request
    # the lean connections write the request themselves: no httpx in between
    assert (b"python-httpx" in request) is (not client.lean_starts)


async def test_only_a_plain_http_worker_without_a_proxy_starts_on_the_lean_connections(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY", "no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)

    async def lean(url: str) -> bool:
        client = WorkerClient(url)
        await client.aclose()
        return client.lean_starts

    assert await lean("http://worker:8000")
    assert not await lean("https://worker:8000")  # TLS: httpx, with the worker client's TLS context
    monkeypatch.setenv("HTTP_PROXY", "http://proxy:3128")
    assert not await lean("http://worker:8000")


async def test_a_stream_read_to_its_end_leaves_its_connection_for_the_next_start(connect: Connect) -> None:
    async with scripted_peer([TOKEN % (0, 0, 0), DONE], keep_alive=True) as peer:
        client = connect(peer.url)
        try:
            for _ in range(2):
                assert (await collect(await client.start(**START))).done is not None  # type: ignore[arg-type]
            assert peer.connections == 1
            stream = await client.start(**START)  # type: ignore[arg-type]
            assert isinstance(await anext(stream), Token)
            await stream.aclose()  # mid-body, as a cancel or a fence aborts: the connection goes
            assert (await collect(await client.start(**START))).done is not None  # type: ignore[arg-type]
            assert peer.connections == 2
        finally:
            await client.aclose()
