"""What the HTTP limits cost (app/http_server.py): uvicorn's h11 protocol against the limited one.

    python ops/bench/http_limits.py [--requests 1000] [--rounds 20]

Two uvicorn servers in this process serve the same tiny ASGI app (a JSON ``200``), one on
uvicorn's own ``H11Protocol`` and one built by ``server_config`` (deadlines per phase, the
measured request head). A client on raw sockets sends ``--requests`` small POSTs with a body,
back to back, on one kept-alive connection (the per-request cost: two phases armed and
disarmed, the head measured) and then each on a new connection (the per-connection cost
too), alternating between the servers round by round. It prints the time per request of
each, in its best round and its median round, and the differences. Client and servers share
one event loop, and the machine's cores with whatever else runs: the best round is the one
least disturbed, and the difference is what matters, not the absolute figures.
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

from app.http_server import HttpLimits, server_config

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
    plain_sock, limited_sock = free_socket(), free_socket()
    options: dict[str, Any] = {"log_level": "warning", "lifespan": "off", "access_log": False}
    plain = uvicorn.Server(uvicorn.Config(app, http="h11", timeout_keep_alive=75, **options))
    limited = uvicorn.Server(server_config(app, HttpLimits(), **options))
    tasks = [
        asyncio.create_task(plain.serve(sockets=[plain_sock])),
        asyncio.create_task(limited.serve(sockets=[limited_sock])),
    ]
    while not (plain.started and limited.started):
        await asyncio.sleep(0.01)
    ports = {"uvicorn h11": plain_sock.getsockname()[1], "limited h11": limited_sock.getsockname()[1]}
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
            print(f"  {name:12} {best[name]:8.1f} {medians[name]:8.1f}")
        gaps = [best["limited h11"] - best["uvicorn h11"], medians["limited h11"] - medians["uvicorn h11"]]
        print(f"  difference   {gaps[0]:+8.1f} {gaps[1]:+8.1f}")
    plain.should_exit = limited.should_exit = True
    await asyncio.gather(*tasks)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=20)
    arguments = parser.parse_args()
    asyncio.run(main(arguments.requests, arguments.rounds))
