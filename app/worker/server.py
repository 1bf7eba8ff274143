"""The worker's HTTP face (Starlette on uvicorn) and its process lifecycle.

``run_worker`` binds the socket first (so ``--port 0`` works and the port can be
reported), serves at once, and loads the engine in the background: until it is loaded,
readiness and starts answer 503 ``not_ready``. SIGTERM (or SIGINT) starts the drain of
``Worker.drain``; when it is over the server stops, the engine is closed and the process
exits 0. A second SIGINT forces the exit.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import socket
from types import FrameType
from typing import Any

import uvicorn

from app.http.server import server_config, write_ready_file
from app.telemetry import logs
from app.worker.config import WorkerConfig, make_engine
from app.worker.faults import FaultBook
from app.worker.joiner import Joiner, advertised
from app.worker.joiner import stop as stop_joining
from app.worker.routes import build_app
from app.worker.worker import Worker

log = logging.getLogger("phasegate.worker")


class _Server(uvicorn.Server):
    """uvicorn, with SIGTERM/SIGINT starting the worker's drain instead of a plain stop."""

    def __init__(self, config: uvicorn.Config, worker: Worker, grace_s: float) -> None:
        super().__init__(config)
        self.worker = worker
        self.joiner: Joiner | None = None  # with --join: cordoned first when it drains
        self.grace_s = grace_s
        self.loop: asyncio.AbstractEventLoop | None = None
        self.drain_task: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.drain_task is None and self.loop is not None:
            log.warning("signal %s: draining for up to %.1f s", signal.Signals(sig).name, self.grace_s)
            self.loop.call_soon_threadsafe(self._start_drain)
        elif sig == signal.SIGINT:
            self.force_exit = self.should_exit = True

    def _start_drain(self) -> None:
        if self.drain_task is None:
            self.drain_task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        if self.joiner is not None:
            await self.joiner.cordon()
        await self.worker.drain(self.grace_s)
        self.should_exit = True


def _bind(host: str, port: int) -> socket.socket:
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say they are TCP,
    # and without it every small frame after the first waits for the peer's delayed ACK.
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


async def _serve(config: WorkerConfig) -> int:
    engine = make_engine(config)
    faults: FaultBook | None = None
    if config.enable_faults:
        faults = FaultBook()
        for raw in config.faults:
            faults.add(raw)
    worker = Worker(engine, max_running=config.max_running, max_queued=config.max_queued, faults=faults)
    app = build_app(worker, config, faults)
    sock = _bind(config.host, config.port)
    port = sock.getsockname()[1]
    server = _Server(
        # header and body timeouts, keep-alive (longer than the gateway's httpx: a request
        # sent on a connection the worker was closing got a reset), 431: app/http/server.py
        server_config(
            app,
            config.http,
            log_level=config.log_level,
            log_config=None,  # uvicorn's lines go through the root handler: same format, same redaction
            access_log=False,
            timeout_graceful_shutdown=5,
        ),
        worker,
        config.grace_s,
    )
    server.loop = asyncio.get_running_loop()
    if config.token is None:
        log.warning("worker %s: no token: anyone who reaches %s:%d controls its leases", config.name, config.host, port)
    if config.ready_file is not None:
        write_ready_file(config.ready_file, config.host, port)
    exit_code = 0
    joiner, joining = None, None
    if config.join is not None:
        url = config.advertise or advertised(config.host, port)
        models: dict[str, str | None] = {name: dict(config.revisions).get(name) for name in config.models}
        joiner = server.joiner = Joiner(config.join, config.name, url, models, config.token)

    async def load() -> None:
        nonlocal joining
        nonlocal exit_code
        try:
            await engine.start()
        except Exception:
            log.exception("the %s engine failed to start", engine.name)
            exit_code = 1
            server.should_exit = True
            return
        # The startup heap (vLLM, torch) is static from here on: freeze it so that full
        # collections do not walk it, pausing the token loop for a tenth of a second.
        gc.collect()
        gc.freeze()
        worker.ready = True
        log.warning("worker %s ready on %s:%d (%s engine)", config.name, config.host, port, engine.name)
        if joiner is not None:  # ready first: the gateway probes it before it lets it in
            joining = asyncio.get_running_loop().create_task(joiner.run(), name="fleet membership")

    loader = asyncio.get_running_loop().create_task(load())
    try:
        await server.serve(sockets=[sock])
    finally:
        loader.cancel()
        await stop_joining(joining, joiner)
        await engine.close()
    return exit_code


def run_worker(config: WorkerConfig) -> int:
    """Run a worker until SIGTERM has drained it; the process's exit code."""
    logs.configure(config.log_level, config.log_format)
    logs.redact(config.token)
    logs.bind_instance(lambda: config.name)
    if config.log_format == "json":  # vLLM's lines too: through the root handler, not its own
        os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    # Plain asyncio on purpose: under uvloop, vLLM's output handler (zmq) and a busy
    # stream starved every other connection (renew, cancel) for seconds.
    return asyncio.run(_serve(config))


def main(args: Any) -> int:
    from app.worker.config import config_from_args

    return run_worker(config_from_args(args))
