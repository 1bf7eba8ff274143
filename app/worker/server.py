"""The worker's HTTP face (Starlette on uvicorn) and its process lifecycle.

``run_worker`` binds the socket first (so ``--port 0`` works and the port can be
reported), serves at once, and loads the engine in the background: until it is loaded,
readiness and starts answer 503 ``not_ready``. SIGTERM (or SIGINT) starts the drain of
``Worker.drain``; when it is over the server stops, the engine is closed and the process
exits 0. A second SIGINT forces the exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
import time
from collections.abc import AsyncIterator
from types import FrameType
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from app.contract import worker_protocol
from app.contract.integers import IntegerRefused, exceeds, parse_integer
from app.http.server import server_config, write_ready_file
from app.telemetry import logs
from app.worker.auth import RequireToken
from app.worker.config import WorkerConfig, make_engine
from app.worker.faults import FaultBook
from app.worker.health import HealthProbe
from app.worker.joiner import Joiner, advertised
from app.worker.joiner import stop as stop_joining
from app.worker.json_body import decode_json, decode_json_value
from app.worker.lease_calls import parse_ref, parse_renewals
from app.worker.metrics import CONTENT_TYPE, TokenRate, make_registry, render
from app.worker.protocol import Code, Refusal, parse_start
from app.worker.worker import Worker

log = logging.getLogger("phasegate.worker")


def refusal_response(refusal: Refusal) -> JSONResponse:
    headers = {} if refusal.retry_after is None else {"retry-after": str(refusal.retry_after)}
    return JSONResponse(refusal.body(), status_code=refusal.status, headers=headers)


async def _on_refusal(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, Refusal)
    return refusal_response(exc)


async def _on_http_error(request: Request, exc: Exception) -> Response:
    """Starlette's 404 and 405 (a path or method no route takes) in the protocol's error shape,
    not its plain text (the fuzz suite's finding)."""
    assert isinstance(exc, HTTPException)
    code = {404: Code.NOT_FOUND, 405: Code.METHOD_NOT_ALLOWED}.get(exc.status_code, Code.INVALID_FIELD)
    response = refusal_response(Refusal(exc.status_code, code, str(exc.detail)))
    response.headers.update(exc.headers or {})
    return response


def check_protocol(request: Request) -> None:
    """Refuse a call that names another protocol version (app/contract/worker_protocol.py)."""
    named = request.headers.get(worker_protocol.HEADER)
    if named is not None and named != str(worker_protocol.VERSION):
        raise Refusal(
            503,
            Code.PROTOCOL_MISMATCH,
            f"this worker speaks protocol {worker_protocol.VERSION}; the call names {named!r}",
            field=worker_protocol.HEADER,
        )


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it is known to exceed ``limit`` bytes."""
    too_large = Refusal(413, Code.BODY_TOO_LARGE, f"the body is over the limit of {limit} bytes")
    declared = request.headers.get("content-length", "")
    if exceeds(declared, limit):
        raise too_large
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_large
    except ClientDisconnect:  # gone mid-body, or cut by the body timeout: a refusal, not a 500
        raise Refusal(499, Code.CLIENT_GONE, "the connection closed before the body was read") from None
    return bytes(body)


def build_app(worker: Worker, config: WorkerConfig, faults: FaultBook | None) -> Starlette:
    """The worker's routes; see docs/worker-protocol.md."""
    health = HealthProbe(worker.engine, config.health_ttl_s, config.health_timeout_s)
    rate = TokenRate()
    registry = make_registry(worker, rate, config.name)
    default_heartbeat_s = config.heartbeat_ms / 1000
    stream_headers = {"x-phasegate-worker": config.name, "cache-control": "no-store"}

    async def body_of(request: Request) -> dict[str, Any]:
        """An attempt call's body (start, renew, cancel), once its protocol version is ours."""
        check_protocol(request)
        return decode_json(await read_body(request, config.max_body_bytes))

    async def start(request: Request) -> Response:
        spec = parse_start(await body_of(request), default_heartbeat_s=default_heartbeat_s)
        logs.bind_request(spec.request_id, spec.attempt)  # this task's lines, its stream's included
        attempt = worker.admit(spec)
        return StreamingResponse(worker.frames(attempt), media_type="application/x-ndjson", headers=stream_headers)

    async def renew(request: Request) -> Response:
        ref = parse_ref(await body_of(request), with_ttl=True)
        worker.stats.renew_calls += 1
        return JSONResponse(worker.renew(ref))

    async def renew_many(request: Request) -> Response:
        # One answer per lease, in order: a refusal of one is an entry, not the call's status.
        answers: list[dict[str, object]] = []
        refs = parse_renewals(await body_of(request))
        worker.stats.renew_calls += 1
        for ref in refs:
            answer: dict[str, object] = {"request_id": ref.request_id, "attempt": ref.attempt}
            try:
                answer |= worker.renew(ref)
            except Refusal as refusal:
                answer |= {"status": refusal.status} | refusal.body()
            answers.append(answer)
        return JSONResponse({"leases": answers})

    async def cancel(request: Request) -> Response:
        ref = parse_ref(await body_of(request), with_ttl=False)
        logs.bind_request(ref.request_id, ref.attempt)
        return JSONResponse(await worker.cancel(ref))

    def _unavailable() -> Refusal | None:
        if worker.draining:
            return Refusal(503, Code.REPLICA_EXITING, "the replica is shutting down")
        if not worker.ready:
            return Refusal(503, Code.NOT_READY, "the engine is still loading", retry_after=1)
        return None

    async def ready(request: Request) -> Response:
        refusal = _unavailable()
        return refusal_response(refusal) if refusal else JSONResponse({"ready": True})

    async def health_check(request: Request) -> Response:
        refusal = _unavailable()
        if refusal:
            return refusal_response(refusal)
        ok, details = await health.check()
        body = {
            "status": "ok" if ok else "unhealthy",
            "protocol": worker_protocol.VERSION,
            **details,
            "running": worker.running,
            "queued": worker.queued,
        }
        if not ok:
            body["error"] = {"code": Code.ENGINE_UNHEALTHY.value, "message": details.get("error", "")}
        return JSONResponse(body, status_code=200 if ok else 503)

    async def info(request: Request) -> Response:
        return JSONResponse(
            {
                "worker_id": config.name,
                "pid": os.getpid(),
                "engine": worker.engine.name,
                "protocol": worker_protocol.VERSION,
                "models": list(worker.engine.models),
                "max_model_len": getattr(worker.engine, "max_model_len", None),
                # each model as the engine's server would list it (vLLM's), where it has one
                "model_cards": worker.engine.model_cards() if hasattr(worker.engine, "model_cards") else None,
                "max_running": worker.max_running,
                "max_queued": worker.max_queued,
                "faults_enabled": faults is not None,
                "ready": worker.ready,
                "draining": worker.draining,
            }
        )

    async def utility(request: Request) -> Response:
        """vLLM's utility routes, answered by the engine (app/worker/vllm_utility.py)."""
        path = request.url.path.removeprefix("/v1/")
        body = await body_of(request) if request.method == "POST" else None
        if body is None:
            check_protocol(request)
        return JSONResponse(worker.engine.utility(path, body))

    async def metrics(request: Request) -> Response:
        return Response(render(registry), media_type=CONTENT_TYPE)

    async def attempts(request: Request) -> Response:
        now = time.monotonic()
        described = [a.describe(now) for a in worker.table.attempts.values()]
        return JSONResponse({"attempts": described, "engine_requests": worker.engine.running_requests()})

    async def admin_faults(request: Request) -> Response:
        if faults is None:
            raise Refusal(403, Code.FAULTS_DISABLED, "this worker was started without --enable-faults")
        if request.method == "POST":
            body = decode_json_value(await read_body(request, config.max_body_bytes) or b"{}")
            specs = body.get("faults", [body]) if isinstance(body, dict) else body
            if not isinstance(specs, list):
                raise Refusal(400, Code.INVALID_FIELD, "give a fault, a list of them or {faults: […]}", field="faults")
            added = [faults.add(spec).describe() for spec in specs]
            return JSONResponse({"added": added})
        if request.method == "DELETE":
            return JSONResponse({"cleared": faults.clear()})
        return JSONResponse({"faults": faults.describe()})

    async def release_fault(request: Request) -> Response:
        if faults is None:
            raise Refusal(403, Code.FAULTS_DISABLED, "this worker was started without --enable-faults")
        body = decode_json_value(await read_body(request, config.max_body_bytes) or b"{}")
        hold_at = body.get("hold_at") if isinstance(body, dict) else None
        if hold_at is not None and (not isinstance(hold_at, int) or isinstance(hold_at, bool) or hold_at < 0):
            raise Refusal(400, Code.INVALID_FIELD, "hold_at: must be a token index", field="hold_at")
        try:
            fault_id = parse_integer(request.path_params["fault_id"], "fault_id", maximum=2**63 - 1)
        except IntegerRefused as exc:
            raise Refusal(400, Code.INVALID_FIELD, str(exc), field="fault_id") from None
        return JSONResponse({"released": faults.release(fault_id, hold_at).describe()})

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async def housekeeping() -> None:
            while True:
                rate.sample(worker.stats.tokens_generated)
                worker.prune()
                await asyncio.sleep(1.0)

        task = asyncio.get_running_loop().create_task(housekeeping())
        try:
            yield
        finally:
            task.cancel()

    routes = [
        Route("/v1/attempts", start, methods=["POST"]),
        Route("/v1/attempts/renew", renew, methods=["POST"]),
        Route("/v1/leases/renew", renew_many, methods=["POST"]),
        Route("/v1/attempts/cancel", cancel, methods=["POST"]),
        Route("/v1/health", health_check, methods=["GET"]),
        Route("/v1/ready", ready, methods=["GET"]),
        Route("/v1/info", info, methods=["GET"]),
        Route("/v1/tokenize", utility, methods=["POST"]),
        Route("/v1/detokenize", utility, methods=["POST"]),
        Route("/v1/version", utility, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/admin/attempts", attempts, methods=["GET"]),
        Route("/admin/faults", admin_faults, methods=["GET", "POST", "DELETE"]),
        Route("/admin/faults/{fault_id}/release", release_fault, methods=["POST"]),
    ]
    app = Starlette(
        routes=routes, lifespan=lifespan, exception_handlers={Refusal: _on_refusal, HTTPException: _on_http_error}
    )
    if config.token is not None:
        app.add_middleware(RequireToken, token=config.token)
    return app


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
