"""One gateway process: uvicorn serving a :class:`~app.process.gateway.Gateway` on sockets bound before.

``phasegate serve`` runs it in its own process (``--processes 1``) or starts N children
that each run it (``python -m app.process.gateway_process``, :mod:`app.process.supervisor`). How a child
works: the parent bound the port once; the child inherits that listening socket (its
descriptor number on the command line), reads what to serve from its standard input
(a :class:`ChildSpec`, pickled by the parent, which alone writes it, in a frame: its
length, then it), and dies with its
parent (``PR_SET_PDEATHSIG``), so a SIGKILLed ``phasegate serve`` leaves no gateway
behind. Each child is an instance of its own (docs/design.md §11): its own id, lease and
sweeps, named ``host:port/i``. Its instance address (where another instance forwards a
stop button) is a second socket of its own on the same host, since the shared port may
reach any child. Its standard input stays open: each configuration reload the parent
accepted comes as a new frame (app/process/reload.py), which the child applies between two
requests (``Gateway.reload``). The parent forwards SIGTERM and SIGINT to the children as SIGTERM:
the first drains, the second ends open streams now, the third stops at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import dataclasses
import gc
import ipaddress
import json
import logging
import os
import pickle
import signal
import socket
import struct
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from app.config import GatewayConfig
from app.http.server import server_config
from app.telemetry import logs

if TYPE_CHECKING:
    import uvicorn

    from app.process.gateway import Gateway

PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class ChildSpec:
    """What a child gateway process serves, as its parent resolved it."""

    config: GatewayConfig
    database_url: str
    log_level: str
    secrets: tuple[str, ...]  # what no log line may hold


def frame(spec: ChildSpec) -> bytes:
    """``spec`` as the parent writes it to a child's standard input: its length, then it."""
    body = pickle.dumps(spec)
    return struct.pack(">I", len(body)) + body


def read_frame(fd: int) -> ChildSpec | None:
    """The next spec on ``fd``; None once the parent closed it."""
    head = _read_exactly(fd, 4)
    body = _read_exactly(fd, struct.unpack(">I", head)[0]) if head is not None else None
    return pickle.loads(body) if body is not None else None  # written by the parent, never by a user


def _read_exactly(fd: int, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        chunk = os.read(fd, left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def quiet_libraries() -> None:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per upstream call is noise
    logging.getLogger("sse_starlette").setLevel(logging.INFO)  # its debug lines hold every chunk's text


JOIN_WAIT_S = 15.0  # how long the start waits for the replicas that join by themselves


async def run_gateway(
    config: GatewayConfig,
    url: str,
    sockets: list[socket.socket],
    on_started: Callable[[], None],
    *,
    address: str | None = None,
    backlog: int = 2048,
    stop_asked: Callable[[], int | None] | None = None,
    on_open: Callable[[Gateway], None] | None = None,
    joining: Sequence[str] = (),
) -> None:
    """Serve ``config``'s gateway on ``sockets`` until a signal drains and stops it;
    ``on_started`` is called once it accepts requests. ``backlog`` is what asyncio passes
    to ``listen`` and how many connections it accepts each time a socket is readable.
    ``stop_asked``: the stop signal received while it started, if any (then it stops as
    soon as it started, as on that signal, and ``on_started`` is not called). ``on_open``
    gets the gateway once it is open, before it serves (where reloads are wired).
    ``joining``: replicas that join by themselves (the demo's simulated workers) that
    ``on_started`` waits for, a few seconds at most, so that the first request finds them."""
    import uvicorn

    from app.process.gateway import Gateway

    class DrainingServer(uvicorn.Server):
        """uvicorn, whose first SIGTERM or SIGINT drains the gateway before it stops."""

        signals = 0

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            self.signals += 1
            if self.signals == 1:
                loop.call_soon_threadsafe(lambda: loop.create_task(self._drain(), name="drain"))
            elif self.signals == 2:  # end open streams now, with their final error, and stop
                print("phasegate stops: open streams end now (a third signal stops at once)", flush=True)
                loop.call_soon_threadsafe(lambda: loop.create_task(gateway.instance.drain(0), name="drain now"))
            else:
                self.should_exit = self.force_exit = True

        async def _drain(self) -> None:
            logs.bind_instance(lambda: gateway.instance_id)  # started by a signal, outside any exchange
            print(f"phasegate drains: open streams get up to {config.drain_s:g}s (a second signal stops now)")
            try:
                await gateway.drain()
            finally:
                self.should_exit = True

    loop = asyncio.get_running_loop()
    gateway = await Gateway.open(config, url)
    if address is not None:  # before the lifespan registers the instance
        gateway.instance.address = address
    if on_open is not None:
        on_open(gateway)
    server = DrainingServer(
        server_config(
            gateway.app,
            config.http_limits,  # header and body timeouts, keep-alive, 431 (app/http/server.py)
            host=config.host,
            port=config.port,
            log_level="warning",
            log_config=None,  # uvicorn's lines go through the root handler: same format, same redaction
            lifespan="on",
            backlog=backlog,
        )
    )

    watch = loop.create_task(_when_started(server, gateway, joining, stop_asked, on_started))
    try:
        await server.serve(sockets=sockets)
    finally:
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch


async def _when_started(
    server: uvicorn.Server,
    gateway: Gateway,
    joining: Sequence[str],
    stop_asked: Callable[[], int | None] | None,
    on_started: Callable[[], None],
) -> None:
    """Once ``server`` accepts requests: the startup heap frozen, the replicas that join by
    themselves waited for, then ``on_started``; or the stop asked while it started."""
    loop = asyncio.get_running_loop()
    while not server.started:
        await asyncio.sleep(0.05)
    # The startup heap (the modules, the app, the configuration) is static from here
    # on: frozen, the collector's full passes no longer walk it (as the worker does).
    # It saves a little CPU and no memory, where raising the collector's thresholds
    # cost memory (figures: docs/performance.md).
    gc.collect()
    gc.freeze()
    deadline = loop.time() + JOIN_WAIT_S
    while not set(joining) <= set(gateway.ctx.pool.replicas) and loop.time() < deadline:
        await asyncio.sleep(0.05)
    asked = stop_asked() if stop_asked is not None else None
    if asked is not None:
        server.handle_exit(asked, None)
        return
    on_started()


# --- a child of ``phasegate serve --processes N`` ------------------------------------------------


def _die_with_parent(parent: int) -> None:
    """SIGKILL this process when its parent ends (Linux); already ended: exit now."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        sys.exit(1)


class Listening(socket.socket):
    """A socket already listening, whose queue length was set by whoever bound it.

    asyncio calls ``listen(backlog)`` on a server's socket, then accepts up to ``backlog``
    connections each time the socket is readable. On the socket that N processes share,
    the first one awake would take a whole burst of connections, and keep them (see each
    process's CPU in ``ops/bench/peers.py --saturation``; figures in docs/performance.md).
    So a child asks for a backlog of one, a connection each wakeup, and the sibling woken
    by the same readiness takes the next; and here ``listen`` keeps the queue length
    that the parent gave the socket, which a backlog of one would otherwise shrink.
    """

    def listen(self, backlog: int = 0, /) -> None:
        pass


def _own_socket(host: str) -> Listening:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = Listening(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # TCP_NODELAY: see bind_listening
    sock.bind((host, 0))
    socket.socket.listen(sock, 128)
    return sock


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.process.gateway_process")
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--listen-fd", type=int, required=True)
    parser.add_argument("--ready-file", type=Path, required=True)
    parser.add_argument("--parent", type=int, required=True)
    args = parser.parse_args(argv)
    _die_with_parent(args.parent)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # reloads come from the parent, on standard input
    spec = read_frame(sys.stdin.fileno())
    if spec is None:
        return 1
    config = spec.config
    logs.configure(spec.log_level, config.log_format)
    quiet_libraries()
    logs.redact(*spec.secrets)
    if config.otel_endpoint:
        from app.telemetry import tracing

        tracing.configure(config.otel_endpoint, config.otel_service_name)  # the parent checked it works
    listener = Listening(fileno=args.listen_fd)
    own = _own_socket(config.host)
    name = f"{config.instance_name or f'{socket.gethostname()}:{config.port}'}/{args.index}"
    config = dataclasses.replace(config, instance_name=name, apply_migrations=False)  # the parent migrated

    def ready() -> None:
        args.ready_file.write_text(json.dumps({"pid": os.getpid(), "index": args.index}))

    address = f"http://{config.host}:{own.getsockname()[1]}"

    def follow_reloads(gateway: Gateway) -> None:
        loop = asyncio.get_running_loop()
        thread = threading.Thread(target=_read_reloads, args=(loop, gateway, name), name="reloads", daemon=True)
        thread.start()

    asyncio.run(
        run_gateway(
            config, spec.database_url, [listener, own], ready, address=address, backlog=1, on_open=follow_reloads
        )
    )
    return 0


def _read_reloads(loop: asyncio.AbstractEventLoop, gateway: Gateway, name: str) -> None:
    """Each spec the parent sends after the first, applied in the gateway's loop."""
    while (spec := read_frame(sys.stdin.fileno())) is not None:
        logs.redact(*spec.secrets)
        config = dataclasses.replace(spec.config, instance_name=name, apply_migrations=False)
        with contextlib.suppress(RuntimeError):  # the loop closed: the process is stopping
            loop.call_soon_threadsafe(gateway.reload, config)


if __name__ == "__main__":
    sys.exit(main())


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (or ``localhost``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind_listening(host: str, port: int) -> socket.socket:
    """The listening socket ``phasegate serve`` makes before anything else starts
    (uvicorn's own way of binding).

    IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on accepted sockets that say they
    are TCP, and a socket accepted from one made with 0 says 0. Without it a stream's
    first event waited behind its response head for the client's delayed ACK (Nagle),
    which added to the time to first token of one gateway process (``--processes 1``;
    figures: docs/performance.md); the
    processes of ``--processes N`` rebuild the socket from its descriptor, which asks the
    kernel and says TCP."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock
