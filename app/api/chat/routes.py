"""Chat completions and completions (docs/design.md §14): ``POST /v1/chat/completions`` and
``POST /v1/completions``. The body is checked against vLLM's request (app/api/chat/request.py),
served as every generation is (app/api/generate.py), and answered in OpenAI's shape
(app/api/chat/shape.py); a stream that was lost is resumed from the log
(app/api/resume/routes.py).
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from app.api.chat.request import parse_request
from app.api.generate import Generate
from app.driver.context import GatewayContext
from app.driver.request import CHAT, COMPLETIONS, GenerationRequest


def chat_routes(ctx: GatewayContext, generate: Generate) -> list[Route]:
    routes = _Chat(ctx, generate)
    return [
        Route("/v1/chat/completions", routes.chat, methods=["POST"]),
        Route("/v1/completions", routes.completions, methods=["POST"]),
    ]


class _Chat:
    def __init__(self, ctx: GatewayContext, generate: Generate) -> None:
        self.ctx = ctx  # its configuration read at each request: a reload changes the limits
        self.generate = generate

    async def chat(self, request: Request) -> Response:
        return await self.generate(request, self._parse_chat)

    async def completions(self, request: Request) -> Response:
        return await self.generate(request, self._parse_completion)

    async def _parse_chat(self, body: Any, tenant: str) -> GenerationRequest:
        return parse_request(CHAT, body, self.ctx.config.limits)

    async def _parse_completion(self, body: Any, tenant: str) -> GenerationRequest:
        return parse_request(COMPLETIONS, body, self.ctx.config.limits)
