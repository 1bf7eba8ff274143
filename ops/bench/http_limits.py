"""What the HTTP server costs a request (app/http/server.py): uvicorn's two protocols, h11
and httptools, against the limited one that phasegate serves on (httptools held to the limits).

    python ops/bench/http_limits.py [--requests 1000] [--rounds 20]

Three uvicorn servers in this process serve the same tiny ASGI app (a JSON ``200``): uvicorn's
own ``H11Protocol`` and ``HttpToolsProtocol``, and the one built by ``server_config``
(deadlines per phase, the measured request head). A client on raw sockets sends
``--requests`` small POSTs with a body, back to back, on one kept-alive connection (the
per-request cost) and then each on a new connection (the per-connection cost too),
alternating between the servers round by round. It prints the time per request of each, in
its best round and its median round, and the limited server's difference from each of
uvicorn's. Client and servers share one event loop, and the machine's cores with whatever
else runs: the best round is the one least disturbed, and the differences are what matter,
not the absolute figures.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import uvicorn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from app.http.server import HttpLimits, server_config

BODY = b'{"model": "sim", "messages": [{"role": "user", "content": "hello"}]}'
REQUEST = (
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
    b"authorization: Bearer sk-bench-0123456789\r\ncontent-length: %d\r\n\r\n%s" % (len(BODY), BODY)
)
ANSWER = b'{"ok":true}'


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(ANSWER)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": ANSWER})


def free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


async def exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(REQUEST)
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 "), head
    await reader.readexactly(len(ANSWER))


async def kept_alive(port: int, count: int) -> float:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    started = time.perf_counter()
    for _ in range(count):
        await exchange(reader, writer)
    elapsed = time.perf_counter() - started
    writer.close()
    return elapsed / count


async def new_connections(port: int, count: int) -> float:
    started = time.perf_counter()
    for _ in range(count):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        await exchange(reader, writer)
        writer.close()
        await writer.wait_closed()
    return (time.perf_counter() - started) / count


async def main(requests: int, rounds: int) -> None:
    options: dict[str, Any] = {"log_level": "warning", "lifespan": "off", "access_log": False}
    servers = {
        "uvicorn h11": uvicorn.Server(uvicorn.Config(app, http="h11", timeout_keep_alive=75, **options)),
        "uvicorn httptools": uvicorn.Server(uvicorn.Config(app, http="httptools", timeout_keep_alive=75, **options)),
        "limited": uvicorn.Server(server_config(app, HttpLimits(), **options)),
    }
    sockets = {name: free_socket() for name in servers}
    tasks = [asyncio.create_task(server.serve(sockets=[sockets[name]])) for name, server in servers.items()]
    while not all(server.started for server in servers.values()):
        await asyncio.sleep(0.01)
    ports = {name: sock.getsockname()[1] for name, sock in sockets.items()}
    for mode, run, count in (
        ("kept alive", kept_alive, requests),
        ("a connection each", new_connections, requests // 4),
    ):
        figures: dict[str, list[float]] = {name: [] for name in ports}
        for port in ports.values():  # warm-up
            await run(port, count // 10 or 1)
        for _ in range(rounds):
            for name, port in ports.items():
                figures[name].append(await run(port, count))
        best = {name: min(values) * 1e6 for name, values in figures.items()}
        medians = {name: statistics.median(values) * 1e6 for name, values in figures.items()}
        print(f"{mode}: {count} requests x {rounds} rounds, us per request (best round, median round)")
        for name in ports:
            print(f"  {name:20} {best[name]:8.1f} {medians[name]:8.1f}")
        for peer in ("uvicorn h11", "uvicorn httptools"):
            gaps = [best["limited"] - best[peer], medians["limited"] - medians[peer]]
            print(f"  {'limited - ' + peer.split()[1]:20} {gaps[0]:+8.1f} {gaps[1]:+8.1f}")
    for server in servers.values():
        server.should_exit = True
    await asyncio.gather(*tasks)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=20)
    arguments = parser.parse_args()
    asyncio.run(main(arguments.requests, arguments.rounds))
