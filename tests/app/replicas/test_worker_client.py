"""The worker client's error mapping and frame parsing, over real sockets.

What a real worker does is covered in tests/app/worker; here a few raw socket peers
produce what a worker never should (a frame split across reads, a reset, a cut frame)
so that each lands on the right typed error.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator, Sequence

import pytest

from app.replicas.base import Done, Frame, Token
from app.replicas.worker_client import WorkerClient
from app.replicas.worker_errors import (
    AttemptEnded,
    ConnectFailed,
    ConnectTimedOut,
    ControlUnanswered,
    LeaseLost,
    MalformedFrame,
    ReadStalled,
    Rejected,
    ReplicaExiting,
    RequestRefused,
    StreamBroken,
    WorkerError,
)
from statemachine.events import FailureKind
from tests.support.streams import collect
from tests.support.workers import free_port

START = {"request_id": "r", "attempt": 1, "lease_epoch": 1, "lease_ttl_s": 5.0, "model": "sim", "prompt": "x"}


@contextlib.asynccontextmanager
async def scripted_peer(pieces: Sequence[bytes], *, reset: bool = False, gap_s: float = 0.01) -> AsyncIterator[str]:
    """An HTTP/1.1 peer that answers any request with 200, a chunked body made of ``pieces``
    (one chunk each, ``gap_s`` apart) and then closes, or resets the connection."""

    handlers: list[asyncio.Task[None]] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handlers.append(asyncio.current_task())  # type: ignore[arg-type]
        try:
            await answer(reader, writer)
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            (int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")),
            0,
        )
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\ntransfer-encoding: chunked\r\n\r\n")
        for piece in pieces:
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
            await asyncio.sleep(gap_s)
        if reset:
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        else:
            writer.write(b"0\r\n\r\n")

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        await asyncio.gather(*handlers, return_exceptions=True)
        await server.wait_closed()


async def run(pieces: Sequence[bytes], *, reset: bool = False) -> tuple[list[Frame], WorkerError | None]:
    async with scripted_peer(pieces, reset=reset) as url:
        client = WorkerClient(url)
        try:
            got = await collect(await client.start(**START))  # type: ignore[arg-type]
        finally:
            await client.aclose()
    return got.frames, got.error


TOKEN = b'{"type":"token","choice":0,"index":%d,"text":" w%d","token_ids":[%d]}\n'
DONE = b'{"type":"done","finish_reason":"stop","finish_reasons":["stop"],"usage":{"completion_tokens":2}}\n'


async def test_frames_split_across_reads_and_packed_into_one():
    body = TOKEN % (0, 0, 0) + TOKEN % (1, 1, 1) + DONE
    frames, error = await run([body[:10], body[10:50], body[50:51], body[51:]])
    assert error is None
    assert [type(f) for f in frames] == [Token, Token, Done]
    assert [f.text for f in frames if isinstance(f, Token)] == [" w0", " w1"]


async def test_an_end_without_done_is_a_broken_stream():
    frames, error = await run([TOKEN % (0, 0, 0)])
    assert len(frames) == 1 and isinstance(error, StreamBroken)
    assert error.kind is FailureKind.REPLICA_EXITED and error.released


async def test_a_reset_is_a_broken_stream():
    _, error = await run([TOKEN % (0, 0, 0)], reset=True)
    assert isinstance(error, StreamBroken) and error.kind is FailureKind.REPLICA_EXITED


async def test_an_end_inside_a_frame_is_malformed():
    frames, error = await run([TOKEN % (0, 0, 0), b'{"type":"tok'])
    assert len(frames) == 1 and isinstance(error, MalformedFrame)
    assert error.kind is FailureKind.LIVENESS_UNCERTAIN and not error.released


@pytest.mark.parametrize(
    "line",
    [b"not json\n", b'{"type":"token","index":0}\n', b'{"type":"wormhole"}\n', b"[1]\n", b"\n"],
    ids=["not-json", "missing-keys", "unknown-type", "not-an-object", "empty-line"],
)
async def test_a_line_that_is_not_a_frame_is_malformed(line: bytes):
    frames, error = await run([TOKEN % (0, 0, 0), line, DONE])
    assert len(frames) == 1 and isinstance(error, MalformedFrame) and error.line == line.rstrip(b"\n")


async def test_error_frames_end_the_attempt():
    frame = b'{"type":"error","code":"engine_error","message":"boom","generated_tokens":4}\n'
    _, error = await run([TOKEN % (0, 0, 0), frame])
    assert isinstance(error, AttemptEnded) and (error.code, error.generated_tokens) == ("engine_error", 4)
    assert error.kind is FailureKind.REPLICA_EXITED and error.released
    _, error = await run([b'{"type":"error","code":"replica_exiting","message":"bye"}\n'])
    assert isinstance(error, ReplicaExiting) and error.kind is FailureKind.REPLICA_EXITED


async def test_connection_refused():
    client = WorkerClient(f"http://127.0.0.1:{free_port()}")
    try:
        with pytest.raises(ConnectFailed) as failed:
            await client.start(**START)  # type: ignore[arg-type]
        assert failed.value.kind is FailureKind.REPLICA_EXITED
        with pytest.raises(ConnectFailed):
            await client.cancel("r", 1, 1)
        assert not await client.ready()
    finally:
        await client.aclose()


async def test_a_connect_that_hangs_is_a_timeout_not_a_death():
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
        client = WorkerClient(f"http://127.0.0.1:{port}", connect_timeout=0.3)
        try:
            with pytest.raises(ConnectTimedOut) as timed_out:
                await client.start(**START)  # type: ignore[arg-type]
        finally:
            await client.aclose()
        assert timed_out.value.kind is FailureKind.LIVENESS_UNCERTAIN and not timed_out.value.released
    finally:
        for filler in fillers:
            filler.close()
        listener.close()


def test_the_error_tree_maps_every_error_onto_a_failure_kind():
    expected = {
        ConnectFailed: FailureKind.REPLICA_EXITED,
        StreamBroken: FailureKind.REPLICA_EXITED,
        ReplicaExiting: FailureKind.REPLICA_EXITED,
        ConnectTimedOut: FailureKind.LIVENESS_UNCERTAIN,
        ReadStalled: FailureKind.LIVENESS_UNCERTAIN,
        MalformedFrame: FailureKind.LIVENESS_UNCERTAIN,
        ControlUnanswered: FailureKind.LIVENESS_UNCERTAIN,
        Rejected: FailureKind.REJECTED,
        RequestRefused: FailureKind.REQUEST_REFUSED,
        AttemptEnded: FailureKind.REPLICA_EXITED,
        LeaseLost: FailureKind.REPLICA_EXITED,
    }
    for cls, kind in expected.items():
        assert issubclass(cls, WorkerError) and cls.kind is kind
    assert {kind for kind in FailureKind} - set(expected.values()) == {FailureKind.OVERLOADED}  # a timer's call
    assert LeaseLost("x", code="stale_lease_epoch", status=409).released is False
    assert LeaseLost("x", code="unknown_attempt", status=404).released is True


@pytest.mark.parametrize(
    ("field", "param"),
    [
        ("params.top_k", "top_k"),  # a sampling parameter: the client's, under its own name
        ("messages[0].content", "messages[0].content"),
        ("tools[0].function.parameters", "tools[0].function.parameters"),
        ("lease_ttl_ms", None),  # the gateway's own field: no parameter of the client's
        (None, None),
    ],
)
def test_a_refusal_names_the_clients_parameter_where_the_workers_field_is_one(
    field: str | None, param: str | None
) -> None:
    refused = RequestRefused(f"{field}: must be valid", status=400, code="invalid_field", field=field)
    assert refused.param == param and refused.field == field
    assert refused.message == f"{param or field}: must be valid"  # in the client's words
