"""The worker's HTTP routes (docs/worker-protocol.md), as one class over the worker, its
configuration and its fault book; refusals in the protocol's error shape."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from app.contract import worker_protocol
from app.contract.integers import IntegerRefused, exceeds, parse_integer
from app.telemetry import logs
from app.worker.auth import RequireToken
from app.worker.config import WorkerConfig
from app.worker.faults import FaultBook
from app.worker.health import HealthProbe
from app.worker.json_body import decode_json, decode_json_value
from app.worker.lease_calls import parse_ref, parse_renewals
from app.worker.metrics import CONTENT_TYPE, TokenRate, make_registry, render
from app.worker.protocol import Code, Refusal
from app.worker.start_request import parse_start
from app.worker.worker import Worker


def build_app(worker: Worker, config: WorkerConfig, faults: FaultBook | None) -> Starlette:
    """The worker's app: its routes (:class:`WorkerRoutes`), refusals in the protocol's shape,
    the token every call must carry where one is set."""
    routes = WorkerRoutes(worker, config, faults)
    app = Starlette(
        routes=routes.routes(),
        lifespan=routes.lifespan,
        exception_handlers={Refusal: _on_refusal, HTTPException: _on_http_error},
    )
    if config.token is not None:
        app.add_middleware(RequireToken, token=config.token)
    return app


class WorkerRoutes:
    """The worker's routes (docs/worker-protocol.md): the attempt calls, its health and
    readiness, its description, vLLM's utility routes, its metrics, and the admin routes of
    its attempts and injected faults."""

    def __init__(self, worker: Worker, config: WorkerConfig, faults: FaultBook | None) -> None:
        self.worker = worker
        self.config = config
        self.faults = faults
        self.health = HealthProbe(worker.engine, config.health_ttl_s, config.health_timeout_s)
        self.rate = TokenRate()
        self.registry = make_registry(worker, self.rate, config.name)
        self.default_heartbeat_s = config.heartbeat_ms / 1000
        self.stream_headers = {"x-phasegate-worker": config.name, "cache-control": "no-store"}

    def routes(self) -> list[Route]:
        return [
            Route("/v1/attempts", self.start, methods=["POST"]),
            Route("/v1/attempts/renew", self.renew, methods=["POST"]),
            Route("/v1/leases/renew", self.renew_many, methods=["POST"]),
            Route("/v1/attempts/cancel", self.cancel, methods=["POST"]),
            Route("/v1/health", self.health_check, methods=["GET"]),
            Route("/v1/ready", self.ready, methods=["GET"]),
            Route("/v1/info", self.info, methods=["GET"]),
            Route("/v1/tokenize", self.utility, methods=["POST"]),
            Route("/v1/detokenize", self.utility, methods=["POST"]),
            Route("/v1/version", self.utility, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/admin/attempts", self.attempts, methods=["GET"]),
            Route("/admin/faults", self.admin_faults, methods=["GET", "POST", "DELETE"]),
            Route("/admin/faults/{fault_id}/release", self.release_fault, methods=["POST"]),
        ]

    async def body_of(self, request: Request) -> dict[str, Any]:
        """An attempt call's body (start, renew, cancel), once its protocol version is ours."""
        check_protocol(request)
        return decode_json(await read_body(request, self.config.max_body_bytes))

    async def start(self, request: Request) -> Response:
        spec = parse_start(await self.body_of(request), default_heartbeat_s=self.default_heartbeat_s)
        logs.bind_request(spec.request_id, spec.attempt)  # this task's lines, its stream's included
        attempt = await self.worker.admit(spec)
        return StreamingResponse(
            self.worker.frames(attempt), media_type="application/x-ndjson", headers=self.stream_headers
        )

    async def renew(self, request: Request) -> Response:
        ref = parse_ref(await self.body_of(request), with_ttl=True)
        self.worker.stats.renew_calls += 1
        return JSONResponse(self.worker.renew(ref))

    async def renew_many(self, request: Request) -> Response:
        # One answer per lease, in order: a refusal of one is an entry, not the call's status.
        answers: list[dict[str, object]] = []
        refs = parse_renewals(await self.body_of(request))
        self.worker.stats.renew_calls += 1
        for ref in refs:
            answer: dict[str, object] = {"request_id": ref.request_id, "attempt": ref.attempt}
            try:
                answer |= self.worker.renew(ref)
            except Refusal as refusal:
                answer |= {"status": refusal.status} | refusal.body()
            answers.append(answer)
        return JSONResponse({"leases": answers})

    async def cancel(self, request: Request) -> Response:
        ref = parse_ref(await self.body_of(request), with_ttl=False)
        logs.bind_request(ref.request_id, ref.attempt)
        return JSONResponse(await self.worker.cancel(ref))

    def _unavailable(self) -> Refusal | None:
        if self.worker.draining:
            return Refusal(503, Code.REPLICA_EXITING, "the replica is shutting down")
        if not self.worker.ready:
            return Refusal(503, Code.NOT_READY, "the engine is still loading", retry_after=1)
        return None

    async def ready(self, request: Request) -> Response:
        refusal = self._unavailable()
        return refusal_response(refusal) if refusal else JSONResponse({"ready": True})

    async def health_check(self, request: Request) -> Response:
        refusal = self._unavailable()
        if refusal:
            return refusal_response(refusal)
        ok, details = await self.health.check()
        body = {
            "status": "ok" if ok else "unhealthy",
            "protocol": worker_protocol.VERSION,
            **details,
            "running": self.worker.running,
            "queued": self.worker.queued,
        }
        if not ok:
            body["error"] = {"code": Code.ENGINE_UNHEALTHY.value, "message": details.get("error", "")}
        return JSONResponse(body, status_code=200 if ok else 503)

    async def info(self, request: Request) -> Response:
        return JSONResponse(
            {
                "worker_id": self.config.name,
                "pid": os.getpid(),
                "engine": self.worker.engine.name,
                "protocol": worker_protocol.VERSION,
                "models": list(self.worker.engine.models),
                "max_model_len": getattr(self.worker.engine, "max_model_len", None),
                # each model as the engine's server would list it (vLLM's), where it has one
                "model_cards": self.worker.engine.model_cards() if hasattr(self.worker.engine, "model_cards") else None,
                "max_running": self.worker.max_running,
                "max_queued": self.worker.max_queued,
                "faults_enabled": self.faults is not None,
                "ready": self.worker.ready,
                "draining": self.worker.draining,
            }
        )

    async def utility(self, request: Request) -> Response:
        """vLLM's utility routes, answered by the engine (app/worker/vllm_utility.py)."""
        path = request.url.path.removeprefix("/v1/")
        body = await self.body_of(request) if request.method == "POST" else None
        if body is None:
            check_protocol(request)
        return JSONResponse(self.worker.engine.utility(path, body))

    async def metrics(self, request: Request) -> Response:
        return Response(render(self.registry), media_type=CONTENT_TYPE)

    async def attempts(self, request: Request) -> Response:
        now = time.monotonic()
        described = [a.describe(now) for a in self.worker.table.attempts.values()]
        return JSONResponse({"attempts": described, "engine_requests": self.worker.engine.running_requests()})

    async def admin_faults(self, request: Request) -> Response:
        if self.faults is None:
            raise Refusal(403, Code.FAULTS_DISABLED, "this worker was started without --enable-faults")
        if request.method == "POST":
            body = decode_json_value(await read_body(request, self.config.max_body_bytes) or b"{}")
            specs = body.get("faults", [body]) if isinstance(body, dict) else body
            if not isinstance(specs, list):
                raise Refusal(400, Code.INVALID_FIELD, "give a fault, a list of them or {faults: […]}", field="faults")
            added = [self.faults.add(spec).describe() for spec in specs]
            return JSONResponse({"added": added})
        if request.method == "DELETE":
            return JSONResponse({"cleared": self.faults.clear()})
        return JSONResponse({"faults": self.faults.describe()})

    async def release_fault(self, request: Request) -> Response:
        if self.faults is None:
            raise Refusal(403, Code.FAULTS_DISABLED, "this worker was started without --enable-faults")
        body = decode_json_value(await read_body(request, self.config.max_body_bytes) or b"{}")
        hold_at = body.get("hold_at") if isinstance(body, dict) else None
        if hold_at is not None and (not isinstance(hold_at, int) or isinstance(hold_at, bool) or hold_at < 0):
            raise Refusal(400, Code.INVALID_FIELD, "hold_at: must be a token index", field="hold_at")
        try:
            fault_id = parse_integer(request.path_params["fault_id"], "fault_id", maximum=2**63 - 1)
        except IntegerRefused as exc:
            raise Refusal(400, Code.INVALID_FIELD, str(exc), field="fault_id") from None
        return JSONResponse({"released": self.faults.release(fault_id, hold_at).describe()})

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        async def housekeeping() -> None:
            while True:
                self.rate.sample(self.worker.stats.tokens_generated)
                self.worker.prune()
                await asyncio.sleep(1.0)

        task = asyncio.get_running_loop().create_task(housekeeping())
        try:
            yield
        finally:
            task.cancel()


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
