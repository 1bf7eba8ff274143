"""The HTTP limits of both processes (app/http/server.py), over real sockets: a real
``phasegate serve`` (real PostgreSQL, a real sim worker) and that real ``phasegate worker``,
each with timeouts of a second.

- a connection that sends nothing, trickles its headers, withholds or trickles its body, or
  idles after a response is closed when its deadline passes, which a trickle does not move;
- headers over the limit get 431 in the OpenAI error shape, read by the client (uvicorn
  reset the connection before);
- a client inside the limits is served, and nothing refused reaches the log or leaves a
  traceback in the server's output.
"""

from __future__ import annotations

import asyncio
import select
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit

import asyncpg
import httpx
import pytest

from app.cli import main
from app.config import ConfigError, load_config
from app.store.database import asyncpg_dsn
from tests.support.served import served_gateway
from tests.support.workers import running_worker

pytestmark = pytest.mark.slow

HEADER_S = 1.0
BODY_S = 1.0
IDLE_S = 1.5
SLACK_S = 4.0  # a loaded two-core machine may run the deadline late, never early
TOKEN = "limits-test-token-0123456789"
LIMIT_FLAGS = ["--http-header-timeout-s", str(HEADER_S), "--http-body-timeout-s", str(BODY_S)]
LIMIT_FLAGS += ["--http-keep-alive-s", str(IDLE_S)]


@dataclass
class Target:
    name: str
    url: str
    post_path: str  # a POST route that reads a JSON body
    headers: dict[str, str]

    @property
    def address(self) -> tuple[str, int]:
        parts = urlsplit(self.url)
        assert parts.hostname is not None and parts.port is not None
        return parts.hostname, parts.port


@dataclass
class Served:
    gateway: Target
    worker: Target
    database_url: str
    logs: Callable[[], str]  # both servers' output so far


@pytest.fixture(scope="module")
def served(package_database_url: str) -> Iterator[Served]:
    args = ["--model", "sim", "--sim-decode-ms-per-token", "2", *LIMIT_FLAGS]
    with running_worker(args=args, token=TOKEN) as worker:
        settings = {"http_header_timeout_s": HEADER_S, "http_body_timeout_s": BODY_S, "http_keep_alive_s": IDLE_S}
        with served_gateway(package_database_url, worker, settings=settings) as gateway:
            yield Served(
                Target("gateway", gateway.url, "/v1/chat/completions", {}),
                Target("worker", worker.base_url, "/v1/attempts/cancel", {"authorization": f"Bearer {TOKEN}"}),
                package_database_url,
                lambda: gateway.logs() + worker.logs(),
            )


@pytest.fixture(params=["gateway", "worker"])
def target(request: pytest.FixtureRequest, served: Served) -> Target:
    chosen: Target = getattr(served, request.param)
    return chosen


def connect(target: Target) -> socket.socket:
    sock = socket.create_connection(target.address, timeout=SLACK_S + 10)
    return sock


def closed_after(sock: socket.socket, started: float) -> tuple[float, bytes]:
    """Read until the server closes: the seconds since ``started`` and what it sent."""
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass
    return time.monotonic() - started, received


def read_response(sock: socket.socket) -> bytes:
    """One response with a content-length, whole."""
    received = b""
    while b"\r\n\r\n" not in received:
        received += sock.recv(65536)
    head, _, body = received.partition(b"\r\n\r\n")
    length = int(next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))[15:])
    while len(body) < length:
        body += sock.recv(65536)
    return received


def trickle(sock: socket.socket, data: bytes, every_s: float, until_s: float) -> None:
    """Send ``data`` a byte at a time, one each ``every_s``, for at most ``until_s``, or until the
    server answers or closes."""
    stop = time.monotonic() + until_s
    for byte in data:
        if time.monotonic() > stop or select.select([sock], [], [], 0)[0]:
            return
        try:
            sock.sendall(bytes([byte]))
        except OSError:  # the server closed: what the test waits for
            return
        time.sleep(every_s)


def post_head(target: Target, length: int) -> bytes:
    lines = [f"POST {target.post_path} HTTP/1.1", f"host: {target.address[0]}", "content-type: application/json"]
    lines += [f"{name}: {value}" for name, value in target.headers.items()]
    lines.append(f"content-length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def test_a_connection_that_sends_nothing_is_closed(target: Target) -> None:
    started = time.monotonic()
    with connect(target) as sock:
        elapsed, received = closed_after(sock, started)
    assert HEADER_S - 0.1 <= elapsed < HEADER_S + SLACK_S and received == b""


def test_trickled_headers_are_cut_at_the_header_timeout(target: Target) -> None:
    head = post_head(target, 2) + b"{}"
    started = time.monotonic()
    with connect(target) as sock:
        trickle(sock, head, every_s=0.05, until_s=HEADER_S + SLACK_S)  # 0.05 s a byte: never done in time
        elapsed, received = closed_after(sock, started)
    assert HEADER_S - 0.1 <= elapsed < HEADER_S + SLACK_S
    assert received.startswith(b"HTTP/1.1 408 ") and b'"code": "request_timeout"' in received


def test_a_withheld_body_is_cut_at_the_body_timeout(target: Target, served: Served) -> None:
    before = log_size(served.database_url)
    with connect(target) as sock:
        sock.sendall(post_head(target, 100) + b'{"model": ')  # 10 of 100 bytes, then nothing
        started = time.monotonic()
        elapsed, _ = closed_after(sock, started)
    assert BODY_S - 0.1 <= elapsed < BODY_S + SLACK_S
    assert log_size(served.database_url) == before


def test_a_trickled_body_is_cut_at_the_body_timeout(target: Target) -> None:
    body = b'{"request_id": "r", "attempt": 1, "lease_epoch": 1, "padding": "' + b"x" * 200 + b'"}'
    with connect(target) as sock:
        sock.sendall(post_head(target, len(body)))
        started = time.monotonic()
        trickle(sock, body, every_s=0.05, until_s=BODY_S + SLACK_S)
        elapsed, _ = closed_after(sock, started)
    assert BODY_S - 0.1 <= elapsed < BODY_S + SLACK_S


def test_an_idle_kept_alive_connection_is_closed(target: Target) -> None:
    path = "/healthz" if target.name == "gateway" else "/v1/ready"
    with connect(target) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
        answer = read_response(sock)
        started = time.monotonic()
        elapsed, rest = closed_after(sock, started)
    assert answer.startswith(b"HTTP/1.1 200 ") and rest == b""
    assert IDLE_S - 0.1 <= elapsed < IDLE_S + SLACK_S


def test_a_slow_client_inside_the_limits_is_served(target: Target) -> None:
    """Headers in pieces and a body after a pause, each inside its timeout: answered, and the
    kept-alive connection serves a second request."""
    path = "/healthz" if target.name == "gateway" else "/v1/ready"
    with connect(target) as sock:
        request = f"GET {path} HTTP/1.1\r\nhost: x\r\n\r\n".encode()
        for piece in (request[:5], request[5:20], request[20:]):
            sock.sendall(piece)
            time.sleep(HEADER_S / 10)  # well inside the limit, even if a sleep runs long
        first = read_response(sock)
        time.sleep(IDLE_S / 3)
        sock.sendall(request)
        second = read_response(sock)
    assert first.startswith(b"HTTP/1.1 200 ") and second.startswith(b"HTTP/1.1 200 ")


@pytest.mark.parametrize("size", [20_000, 1_000_000])
def test_headers_over_the_limit_get_431(target: Target, served: Served, size: int) -> None:
    before = log_size(served.database_url)
    with httpx.Client(base_url=target.url, timeout=30) as http:
        response = http.post(target.post_path, json={}, headers={**target.headers, "x-large": "a" * size})
    assert response.status_code == 431
    error = response.json()["error"]
    assert (error["code"], error["type"]) == ("request_header_fields_too_large", "invalid_request_error")
    assert response.headers["connection"] == "close"
    assert log_size(served.database_url) == before
    with httpx.Client(base_url=target.url, timeout=30) as http:  # and the server goes on serving
        assert http.get("/healthz" if target.name == "gateway" else "/v1/ready").status_code == 200


def test_malformed_http_gets_400_in_the_error_shape(target: Target) -> None:
    with connect(target) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nno colon here\r\n\r\n")
        _, received = closed_after(sock, time.monotonic())
    assert received.startswith(b"HTTP/1.1 400 ") and b'"code": "invalid_http_request"' in received


def test_no_refusal_left_a_traceback(served: Served) -> None:
    """Last in the module: the refusals of every test above, the clients cut mid-body among
    them (the gateway and the worker logged a ClientDisconnect traceback for those)."""
    logs = served.logs()
    assert "Invalid HTTP request received" in logs  # the output is the servers'
    assert "Traceback" not in logs, logs


def test_the_limits_are_checked_at_load() -> None:
    for setting, value in (
        ("http_header_timeout_s", 0),
        ("http_body_timeout_s", -1.0),
        ("http_keep_alive_s", True),
        ("http_max_header_bytes", 100),
    ):
        with pytest.raises(ConfigError, match=setting):
            load_config(None, **{setting: value})
    limits = load_config(None, http_header_timeout_s=2.5, http_max_header_bytes=4096).http_limits
    assert (limits.header_timeout_s, limits.max_header_bytes) == (2.5, 4096)
    with pytest.raises(SystemExit, match="--http-body-timeout-s must be a positive"):
        main(["worker", "--http-body-timeout-s", "0"])


def log_size(database_url: str) -> tuple[int, int]:
    """Events and requests in the log."""

    async def count() -> tuple[int, int]:
        connection = await asyncpg.connect(asyncpg_dsn(database_url))
        try:
            events = await connection.fetchval("SELECT count(*) FROM request_events")
            requests = await connection.fetchval("SELECT count(DISTINCT request_id) FROM request_events")
            return int(events), int(requests)
        finally:
            await connection.close()

    return asyncio.run(count())
