"""What ``vllm serve`` (or the OpenAI API its clients speak) has and phasegate does not
serve, refused by name (docs/design.md §17): a 404 in the OpenAI error shape, code
``not_served``, whose message says what the route is and why phasegate does not serve it,
so that a client that calls one learns so at once, rather than from a bare ``Not Found``.
docs/compatibility.md lists the same routes with the same reasons (tests/app/api/test_unserved_routes.py
holds the two together).

Every method is refused, since the route is not served at all; the client is not
authenticated first: a refusal that is the same for every caller reveals nothing.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app.api.errors import NotFound, retry_headers
from app.api.request_ids import new_request_id

METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]

_AUDIO = (
    "audio: phasegate serves text generation only, each request an event-sourced stream of text deltas;"
    " send audio to a speech server directly"
)
_REALTIME = (
    "realtime sessions: a realtime session is a long-lived two-way connection, not a request that"
    " phasegate can log, retry before its commit point, resume or replay"
)
_BATCH = (
    "batch files and batches: phasegate keeps no files; send each request of a batch as its own"
    " request (each is logged, retried and answered on its own)"
)
_CLOUD = (
    "a cloud platform's invocation route (SageMaker's): phasegate's own routes are the OpenAI API's;"
    " point the platform at /v1/chat/completions, and its health check at /health"
)
_ENGINE = (
    "the engine's control (LoRA adapters, sleep, profiling, caches, RPC): the operator's, on each"
    " replica, never a client's through the gateway (docs/design.md §13)"
)

# the route (a prefix where it ends in '/'), and why it is not served
NOT_SERVED: dict[str, str] = {
    "/v1/audio/transcriptions": _AUDIO,
    "/v1/audio/translations": _AUDIO,
    "/v1/audio/speech": _AUDIO,
    "/v1/realtime": _REALTIME,
    "/v1/realtime/": _REALTIME,
    "/v1/files": _BATCH,
    "/v1/files/": _BATCH,
    "/v1/batches": _BATCH,
    "/v1/batches/": _BATCH,
    "/v1/chat/completions/batch": _BATCH,
    "/invocations": _CLOUD,
    "/ping": _CLOUD,
    "/v1/load_lora_adapter": _ENGINE,
    "/v1/unload_lora_adapter": _ENGINE,
    "/sleep": _ENGINE,
    "/wake_up": _ENGINE,
    "/is_sleeping": _ENGINE,
    "/start_profile": _ENGINE,
    "/stop_profile": _ENGINE,
    "/reset_prefix_cache": _ENGINE,
    "/reset_mm_cache": _ENGINE,
    "/reset_encoder_cache": _ENGINE,
    "/collective_rpc": _ENGINE,
}


def unserved_routes() -> list[Route]:
    routes = []
    for path, why in NOT_SERVED.items():
        pattern = path + "{rest:path}" if path.endswith("/") else path
        routes.append(Route(pattern, _refusal(path.rstrip("/"), why), methods=METHODS))
    return routes


def _refusal(path: str, why: str) -> Callable[[Request], Awaitable[Response]]:
    async def refuse(request: Request) -> Response:
        error = NotFound(f"phasegate does not serve {path}: {why} (docs/compatibility.md)", code="not_served")
        request_id = new_request_id()
        headers = {"x-request-id": request_id, **retry_headers(error.retryable)}
        return JSONResponse(error.body(request_id), status_code=404, headers=headers)

    return refuse
