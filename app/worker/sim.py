"""A deterministic simulated engine: seeded tokens with vLLM-like timing and abort.

How this works: each request runs as its own task, as in a real engine where decoding
goes on whether or not anyone reads: it sleeps the prefill time (per prompt token),
then produces one token per choice per decode step into a queue that ``generate``
drains. ``abort`` cancels that task and returns once it has stopped (after an optional
delay that stands for the engine finishing its step in flight), with the number of
tokens it had produced.

The text is a pure function of the request: model, rendered prompt, seed, temperature,
top_p (and vLLM's top_k, min_p, repetition_penalty when given) and choice seed a
``random.Random``, so every replica produces the same tokens for the same request.
``min_tokens`` holds the end off that long; a structured-output ``choice`` is answered
with one of its strings, ``json``/``json_object`` with a JSON text; ``regex`` and
``grammar`` are passed over (the sim's words are not constrained by them). Log
probabilities, when asked for, are a function of each token's id; the prompt's (its words
the sim's prompt tokens), a function of each word. Tool-call
ids derive from the request id, so two attempts of one request emit the same id (and the same idempotency key).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from app.contract import json_depth as deep_json
from app.worker import sim_pooling
from app.worker.engine import EngineFailed, EngineOutput, PooledOutput, Prepared, ToolCallOutput, prompt_too_long
from app.worker.protocol import AttemptSpec, Code, Refusal, Sampling
from app.worker.sim_tokens import VOCAB, VOCAB_SIZE, prompt_logprobs, token_logprob

EOS_TOKEN_ID = VOCAB_SIZE  # never emitted as text
MAX_LOGPROBS = 20  # the most alternatives at a prompt token, as vLLM's default max_logprobs
_FINISHED = None  # queue sentinel


def tool_call_id(request_id: str, choice: int, index: int) -> str:
    """The id of a tool call: the same for every attempt of one request."""
    digest = hashlib.sha256(f"{request_id}\0{choice}\0{index}".encode()).hexdigest()
    return "call_" + digest[:24]


def render_prompt(spec: AttemptSpec) -> str:
    """The sim's 'chat template': role-tagged lines, tools appended as JSON."""
    text = spec.prompt_text()
    if spec.sampling.tools:
        text += "\ntools: " + deep_json.dumps(
            spec.sampling.tools, sort_keys=True, separators=(", ", ": "), ensure_ascii=True
        )
    return text


@dataclass(frozen=True, slots=True)
class SimTiming:
    prefill_s_per_token: float = 0.0001
    decode_s_per_token: float = 0.002
    abort_s: float = 0.0
    tokens_per_delta: int = 1  # engine tokens in each output, as vLLM's stream interval batches them


class _Running:
    __slots__ = ("generated", "queue", "task")

    def __init__(self) -> None:
        # outputs; then None (finished) or the EngineFailed that ended the request
        self.queue: asyncio.Queue[EngineOutput | EngineFailed | None] = asyncio.Queue()
        self.generated = 0
        self.task: asyncio.Task[None] | None = None


class SimEngine:
    """The ``sim`` engine; see the module docstring."""

    name = "sim"
    generates = True  # and pools: every pooling route, with deterministic vectors

    def __init__(
        self, models: tuple[str, ...] = ("sim",), timing: SimTiming | None = None, max_model_len: int = 32768
    ) -> None:
        self.models = models
        self.timing = timing or SimTiming()
        self.max_model_len = max_model_len
        self._running: dict[str, _Running] = {}

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        for rid in list(self._running):
            await self.abort(rid)

    async def prepare(self, spec: AttemptSpec) -> Prepared:
        if spec.pooling is not None:
            return _pooled(spec)
        # each prompt of a batch on its own (its text and tokens), as one prompt is
        texts = [render_prompt(dataclasses.replace(spec, prompt=p)) for p in spec.batch] or [render_prompt(spec)]
        prompts = [(text, max(1, len(text.split()))) for text in texts]
        for _, prompt_tokens in prompts:
            if prompt_tokens >= self.max_model_len:
                raise prompt_too_long(prompt_tokens, self.max_model_len)
        asked = VOCAB_SIZE if spec.prompt_logprobs == -1 else spec.prompt_logprobs
        if asked is not None and asked > MAX_LOGPROBS:  # in vLLM's words
            why = f"Requested prompt logprobs of {asked}, which is greater than max allowed: {MAX_LOGPROBS}"
            raise Refusal(400, Code.INVALID_FIELD, why, field="prompt_logprobs")
        counts = tuple(tokens for _, tokens in prompts)
        return Prepared(spec=spec, prompt_tokens=sum(counts), payload=prompts, each_prompt=counts if spec.batch else ())

    def generate(self, engine_request_id: str, prepared: Prepared) -> AsyncIterator[EngineOutput]:
        running = _Running()
        self._running[engine_request_id] = running
        running.task = asyncio.get_running_loop().create_task(self._run(running, prepared))
        running.task.add_done_callback(lambda _: self._forget(engine_request_id, running))
        return self._drain(engine_request_id, running)

    def _forget(self, engine_request_id: str, running: _Running) -> None:
        if self._running.get(engine_request_id) is running:
            del self._running[engine_request_id]

    async def _drain(self, engine_request_id: str, running: _Running) -> AsyncIterator[EngineOutput]:
        # The reader going away does not stop the request (as in vLLM): only abort does.
        queue = running.queue
        while True:
            output = queue.get_nowait() if queue.qsize() else await queue.get()
            if output is _FINISHED:
                return
            if isinstance(output, EngineFailed):
                raise output
            yield output

    def utility(self, path: str, body: dict[str, Any] | None) -> dict[str, Any]:
        raise Refusal(501, Code.NOT_SERVED, f"the sim engine has no tokenizer: /v1/{path} is served by --engine vllm")

    def running_requests(self) -> list[str]:
        return list(self._running)

    async def abort(self, engine_request_id: str) -> int | None:
        running = self._running.pop(engine_request_id, None)
        if running is None or running.task is None:
            return None
        if self.timing.abort_s:
            await asyncio.sleep(self.timing.abort_s)  # the step in flight finishes meanwhile
        running.task.cancel()
        await asyncio.wait({running.task})  # returns once the task has really stopped
        running.queue.put_nowait(EngineOutput(0, [], "", "abort"))
        running.queue.put_nowait(_FINISHED)
        return running.generated

    async def _run(self, running: _Running, prepared: Prepared) -> None:
        # A request's task that dies must end its stream at once: else the reader waits
        # forever and the worker heartbeats "prefill" until the gateway gives up.
        try:
            await self._produce(running, prepared)
        except Exception as exc:
            running.queue.put_nowait(EngineFailed(f"the sim failed on this request: {exc!r}"))

    async def _produce(self, running: _Running, prepared: Prepared) -> None:
        timing, spec = self.timing, prepared.spec
        put = running.queue.put_nowait
        if timing.prefill_s_per_token:
            await asyncio.sleep(timing.prefill_s_per_token * prepared.prompt_tokens)
        if spec.pooling is not None:  # no decode: the answer, whole
            output = EngineOutput(0, [], "", "stop")
            output.answer = prepared.payload
            put(output)
            put(_FINISHED)
            return
        n, top = spec.sampling.n, spec.prompt_logprobs
        choices = [
            _Choice(spec, text, c, self.max_model_len - prompt_tokens, k * n)
            for k, (text, prompt_tokens) in enumerate(prepared.payload)
            for c in range(n)
        ]
        if top is not None:  # each choice's first output says its prompt's
            for choice in choices:
                choice.prompt_logprobs = prompt_logprobs(choice.prompt, top)
        live = choices
        while live:
            if timing.decode_s_per_token:
                await asyncio.sleep(timing.decode_s_per_token)
            else:
                await asyncio.sleep(0)
            for choice in live:
                output = choice.step()
                for _ in range(timing.tokens_per_delta - 1):
                    if output.finish_reason is not None:
                        break
                    more = choice.step()
                    logprobs = None if output.logprobs is None else output.logprobs + (more.logprobs or [])
                    said = output.prompt_logprobs
                    output = EngineOutput(
                        choice.choice,
                        output.token_ids + more.token_ids,
                        output.text + more.text,
                        more.finish_reason,
                        logprobs=logprobs,
                    )
                    output.prompt_logprobs = said
                running.generated += len(output.token_ids)
                put(output)
            live = [c for c in live if c.finish_reason is None]
        put(_FINISHED)


class _Choice:
    """One choice's deterministic token stream: choice ``choice`` of ``prompt``, the answer's
    choice ``first + choice`` (a batch's prompt k answers as that prompt alone)."""

    def __init__(self, spec: AttemptSpec, prompt: str, choice: int, room: int, first: int = 0) -> None:
        s: Sampling = spec.sampling
        material = f"{spec.model}\0{prompt}\0{s.seed}\0{s.temperature}\0{s.top_p}\0{choice}"
        extras = (s.top_k, s.min_p, s.repetition_penalty)
        if extras != (None, None, None):  # given only: the text of a request without them stays as it was
            material += "\0" + "\0".join(map(str, extras))
        self.rng = random.Random(hashlib.sha256(material.encode()).digest())
        self.prompt = prompt
        self.prompt_logprobs: list[Any] | None = None  # said with its first output, where asked
        self.choice = first + choice
        self.stop = s.stop
        self.top_logprobs = s.logprobs
        natural = max(self.rng.randint(16, 128), s.min_tokens)
        self.length = min(s.max_tokens or 16, room) if s.ignore_eos else min(natural, s.max_tokens or natural, room)
        # an answer that reaches max_tokens ends by length, as vLLM's does: its end of
        # sequence would have been one token more
        self.ends_by_length = s.ignore_eos or self.length < natural or self.length == s.max_tokens
        self.produced = 0
        self.text = ""
        self.finish_reason: str | None = None
        self.script = self._script(spec, s, choice)

    def _script(self, spec: AttemptSpec, s: Sampling, choice: int) -> list[tuple[int, str]] | ToolCallOutput | None:
        if s.tools and s.tool_choice != "none":
            chosen = s.tool_choice
            name = chosen["function"]["name"] if isinstance(chosen, dict) else s.tool_names()[0]
            schema = next(t["function"] for t in s.tools if t["function"]["name"] == name).get("parameters") or {}
            arguments = json.dumps(self._arguments(schema), sort_keys=True)
            return ToolCallOutput(0, tool_call_id(spec.request_id, choice, 0), name, arguments)
        structured = s.structured_outputs or {}
        if "choice" in structured:  # one of the strings, whole, as one token
            return [(VOCAB_SIZE + 2, self.rng.choice(structured["choice"]))]
        if (s.response_format and s.response_format.get("type") != "text") or {"json", "json_object"} & set(structured):
            return [(VOCAB_SIZE + 1, '{"text": "')]
        return None

    def _arguments(self, schema: dict[str, Any]) -> dict[str, Any]:
        properties = schema.get("properties") or {"query": {"type": "string"}}
        out: dict[str, Any] = {}
        for key, prop in sorted(properties.items()):
            kind = prop.get("type") if isinstance(prop, dict) else None
            if kind in ("integer", "number"):
                out[key] = self.rng.randint(0, 100)
            elif kind == "boolean":
                out[key] = self.rng.random() < 0.5
            else:
                out[key] = (VOCAB[self.rng.randrange(VOCAB_SIZE)] + VOCAB[self.rng.randrange(VOCAB_SIZE)]).strip()
        return out

    def step(self) -> EngineOutput:
        output = self._step()
        if self.top_logprobs is not None and output.tool_call is None:
            output.logprobs = [token_logprob(token_id, output.text, self.top_logprobs) for token_id in output.token_ids]
        output.prompt_logprobs, self.prompt_logprobs = self.prompt_logprobs, None
        return output

    def _step(self) -> EngineOutput:
        if isinstance(self.script, ToolCallOutput):
            self.finish_reason = "tool_calls"
            ids = [self.rng.randrange(VOCAB_SIZE) for _ in range(8)]
            return EngineOutput(self.choice, ids, "", "tool_calls", self.script)
        if self.script:
            token_id, text = self.script.pop(0)
            if token_id == VOCAB_SIZE + 2:  # a structured choice: that string is the whole answer
                self.text, self.finish_reason = text, "stop"
                self.produced += 1
                return EngineOutput(self.choice, [token_id], text, "stop")
        else:
            token_id = self.rng.randrange(VOCAB_SIZE)
            text = VOCAB[token_id]
        self.produced += 1
        before = len(self.text)
        self.text += text
        for stop in self.stop:
            at = self.text.find(stop, max(0, before - len(stop) + 1))
            if at != -1:
                self.text = self.text[:at]
                self.finish_reason = "stop"
                return EngineOutput(self.choice, [token_id], self.text[before:], "stop")
        if self.produced >= self.length:
            self.finish_reason = "length" if self.ends_by_length else "stop"
            if self.finish_reason == "stop" and self.text.startswith('{"text": "'):
                text += '"}'
        return EngineOutput(self.choice, [token_id], text, self.finish_reason)


def _pooled(spec: AttemptSpec) -> Prepared:
    """A pooling request, answered now (its vectors are a pure function of the request:
    app/worker/sim_pooling.py) and handed out after the prefill's time."""
    assert spec.pooling is not None
    try:
        value, headers = sim_pooling.answer(
            spec.pooling, dict(spec.fields), spec.model, spec.request_id, int(time.time())
        )
    except sim_pooling.PoolingRefused as refused:
        raise Refusal(400, Code.INVALID_FIELD, str(refused), field=refused.param) from None
    tokens = sim_pooling.prompt_tokens(value, headers)
    return Prepared(spec=spec, prompt_tokens=tokens, payload=PooledOutput(value, headers))
