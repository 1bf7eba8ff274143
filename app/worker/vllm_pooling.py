"""Pooling requests on the worker's ``vllm`` engine (docs/design.md §17), answered by vLLM
0.32's own pooling servers, so that a worker answers as ``vllm serve`` does for the same
model and flags (docs/design.md §14).

- The servers (``ServingEmbedding``, ``ServingPooling``, ``ServingClassification``,
  ``ServingScores``) are built by ``vllm serve``'s own ``init_pooling_state`` over the
  worker's ``AsyncLLM``, with the served names as its models. The routes served are those
  ``vllm serve`` registers for the model's tasks (``register_pooling_api_routers``): any
  other pooling route is refused 404, as vLLM's server has no such route for the model.
- A body is read by the route's request model (the one vLLM's route declares), then
  prepared as vLLM's server prepares it (``_init_ctx``, ``_preprocessing``: rendered,
  truncated, held to the model's length; its pooling parameters checked against the
  model), at admission: what vLLM refuses is refused before the attempt starts, with
  vLLM's status, message and ``param`` (app/worker/vllm_requests.py), the client's 400.
- Once the attempt has its slot the engine pools it (``_prepare_generators``, under engine
  request ids that begin with the worker's, ``_collect_batch``) and vLLM's server writes
  the answer (``_postprocessing``): its JSON body read back as the answer's JSON value
  (vLLM writes a float32 as its shortest text, and that text is what a client reads), or
  for ``encoding_format`` ``bytes``/``bytes_only`` its bytes, with its ``metadata`` header.
- Scoring runs vLLM's plain path, never its "flash late interaction" one (an optimization
  of late-interaction models whose preparation cannot be split from its pooling).
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from app.worker.engine import PooledOutput, Prepared
from app.worker.protocol import AttemptSpec, Code, Refusal
from app.worker.vllm_requests import vllm_refusal

# the server that answers each pooling route, by its name in vLLM's app state
SERVERS = {
    "/v1/embeddings": "serving_embedding",
    "/v2/embed": "serving_embedding",
    "/pooling": "serving_pooling",
    "/classify": "serving_classification",
    "/score": "serving_scores",
    "/v1/score": "serving_scores",
    "/rerank": "serving_scores",
    "/v1/rerank": "serving_scores",
    "/v2/rerank": "serving_scores",
}
KEPT_HEADERS = ("metadata",)  # a bytes answer's description (app/replicas/pooled.py keeps the same)


@dataclass(slots=True)
class _PreparedPooling:
    """A prepared pooling request: vLLM's server, its input processor and its context."""

    server: Any
    io_processor: Any
    ctx: Any


class _Routes:
    """What ``vllm serve`` routes for the model: the paths its pooling routers declare,
    with the request model of each (collected as its app includes them)."""

    def __init__(self) -> None:
        self.models: dict[str, Any] = {}

    def include_router(self, router: Any) -> None:
        for route in router.routes:
            self.models[route.path] = inspect.signature(route.endpoint).parameters["request"].annotation


class VllmPooling:
    """vLLM's pooling servers over one ``AsyncLLM`` whose model pools."""

    def __init__(
        self, llm: Any, models: tuple[str, ...], model_path: str, tasks: tuple[str, ...], chat_template: str | None
    ) -> None:
        from vllm.entrypoints.openai.models.protocol import BaseModelPath  # type: ignore[import-not-found, unused-ignore]
        from vllm.entrypoints.openai.models.serving import OpenAIServingModels  # type: ignore[import-not-found, unused-ignore]
        from vllm.entrypoints.pooling.factories import (  # type: ignore[import-not-found, unused-ignore]
            init_pooling_state,
            register_pooling_api_routers,
        )

        paths = [BaseModelPath(name=name, model_path=model_path) for name in models]
        self._state = SimpleNamespace(openai_serving_models=OpenAIServingModels(llm, paths))
        args = SimpleNamespace(  # vllm serve's defaults, and the worker's --chat-template
            chat_template=chat_template,
            chat_template_content_format="auto",
            trust_request_chat_template=False,
            trust_request_mm_kwargs=False,
            enable_flash_late_interaction=False,  # the module docstring
        )
        init_pooling_state(llm, self._state, args, None, tasks)
        routes = _Routes()
        register_pooling_api_routers(routes, tasks, llm.model_config)  # type: ignore[arg-type, unused-ignore]
        self._request_models = {path: model for path, model in routes.models.items() if path in SERVERS}
        self._model_config = llm.model_config

    @property
    def routes(self) -> tuple[str, ...]:
        return tuple(self._request_models)

    async def prepare(self, spec: AttemptSpec) -> Prepared:
        """The request read and prepared by vLLM's server for its route, or vLLM's refusal."""
        from pydantic import TypeAdapter

        assert spec.pooling is not None
        request_model = self._request_models.get(spec.pooling)
        if request_model is None:  # vllm serve has no such route for this model: its 404
            why = f"{spec.pooling}: not served for this model, as vllm serve serves {', '.join(self.routes)}"
            raise Refusal(404, Code.NOT_FOUND, why, field="pooling")
        server = getattr(self._state, SERVERS[spec.pooling], None)
        if server is None:  # a route whose server the model's task leaves out: vLLM's 501
            raise Refusal(501, Code.NOT_SERVED, f"{spec.pooling}: the model does not support it", field="pooling")
        try:
            request = TypeAdapter(request_model).validate_python({**spec.fields, "model": spec.model})
            io_processor = server.get_io_processor(request)
            ctx = await server._init_ctx(io_processor, request, None)
            await server._preprocessing(io_processor, ctx)
            ctx.pooling_params.verify(self._model_config)  # as its _prepare_generators will, first
        except NotImplementedError as exc:  # what vLLM's server answers 501: not served for this model
            raise Refusal(501, Code.NOT_SERVED, str(exc)) from None
        except Exception as exc:  # vLLM's request checks, as its server answers them
            raise vllm_refusal(exc) from None
        tokens = sum(server._extract_prompt_len(engine_input["prompts"]) for engine_input in ctx.engine_inputs)
        return Prepared(spec=spec, prompt_tokens=tokens, payload=_PreparedPooling(server, io_processor, ctx))

    @staticmethod
    def engine_requests(prepared: Prepared, engine_request_id: str) -> list[str]:
        """The engine requests the attempt makes, each named by the worker's id first (the
        ids vLLM's server would give them after it)."""
        ctx = prepared.payload.ctx
        own = ctx.prompt_request_ids or [f"{ctx.request_id}-{i}" for i in range(len(ctx.engine_inputs))]
        ctx.prompt_request_ids = [f"{engine_request_id}:{rid}" for rid in own]
        return list(ctx.prompt_request_ids)

    @staticmethod
    async def answer(prepared: Prepared) -> PooledOutput:
        """Pool the prepared request and write vLLM's answer to it (once
        :meth:`engine_requests` named its engine requests)."""
        pooling: _PreparedPooling = prepared.payload
        server, ctx = pooling.server, pooling.ctx
        await server._prepare_generators(ctx)
        await server._collect_batch(ctx)
        response = await server._postprocessing_async(pooling.io_processor, ctx)
        if getattr(response, "body_iterator", None) is not None:  # a bytes answer: vLLM streams its parts
            parts = [part async for part in response.body_iterator]
            headers = {name: response.headers[name] for name in KEPT_HEADERS if name in response.headers}
            return PooledOutput(b"".join(parts), headers)
        return PooledOutput(json.loads(response.body), {})
