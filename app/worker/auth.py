"""The worker protocol's shared secret: where it comes from, and the check on every call.

How this works: a worker started with a token (``--token-file``, or the environment
variable ``PHASEGATE_WORKER_TOKEN``) wraps its application in :class:`RequireToken`,
which answers 401 to any request that does not carry ``Authorization: Bearer <token>``,
before routing and before the body is read, so a refused call changes nothing. Only the
probes (:data:`OPEN_PATHS`: health, readiness, metrics) stay open; they show no request
ids. The gateway sends the same token (``worker_token`` in its configuration).

The comparison is of SHA-256 digests with :func:`hmac.compare_digest`: constant time,
and equal lengths whatever the caller sent.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from pathlib import Path
from typing import Any

from app.contract.worker_token import TOKEN_ENV, check_token, read_token_file
from app.worker.protocol import Code

# Probes and scrapers need no secret; everything else (start, renew, cancel, info, admin) does.
OPEN_PATHS = frozenset({"/v1/health", "/v1/ready", "/metrics"})
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1", "localhost"})

_UNAUTHORIZED = json.dumps(
    {"error": {"code": Code.UNAUTHORIZED.value, "message": "this worker requires Authorization: Bearer <worker token>"}}
).encode()


def token_from(token_file: Path | None, environ: dict[str, str] | None = None) -> str | None:
    """The worker's token: ``token_file`` if given, else ``$PHASEGATE_WORKER_TOKEN``, else None."""
    if token_file is not None:
        return read_token_file(token_file)
    value = (os.environ if environ is None else environ).get(TOKEN_ENV)
    return check_token(value, TOKEN_ENV) if value else None


class RequireToken:
    """ASGI middleware: every HTTP path but :data:`OPEN_PATHS` needs the bearer token."""

    def __init__(self, app: Any, token: str) -> None:
        self.app = app
        self._digest = hashlib.sha256(token.encode()).digest()

    def allows(self, authorization: bytes | None) -> bool:
        scheme, _, presented = (authorization or b"").partition(b" ")
        if scheme.lower() != b"bearer":
            # compare anyway, so a missing header costs what a wrong one does
            presented = b""
        return hmac.compare_digest(hashlib.sha256(presented.strip()).digest(), self._digest)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        authorization = next((value for name, value in scope["headers"] if name == b"authorization"), None)
        if self.allows(authorization):
            await self.app(scope, receive, send)
            return
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(_UNAUTHORIZED)).encode()),
                    (b"www-authenticate", b'Bearer realm="phasegate-worker"'),
                ],
            }
        )
        await send({"type": "http.response.body", "body": _UNAUTHORIZED})
