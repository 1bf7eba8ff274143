"""Which tenant a request comes from: its API key (``Authorization: Bearer <key>``).

With no ``api_keys`` configured the gateway is open and every request is tenant
``default``. Keys are compared in constant time.
"""

from __future__ import annotations

import hmac

from starlette.requests import Request

from app.api.errors import Unauthorized
from app.config import GatewayConfig


def tenant_of(config: GatewayConfig, request: Request) -> str:
    """The tenant whose key the request carries; :class:`Unauthorized` otherwise."""
    keys = config.api_keys
    if not keys:
        return "default"
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
    for key, tenant in keys.items():
        if hmac.compare_digest(key.encode(), token.encode()):
            return tenant
    raise Unauthorized("incorrect API key")
