"""The port between the worker and the engine it owns.

An engine turns a prepared prompt into a stream of :class:`EngineOutput` and can abort
a request by id. It runs independently of whoever reads its stream (as vLLM does):
``abort`` returns only once the engine has really stopped the request, and that return
is what the worker's cancel acknowledgement waits for. Engines know nothing of leases,
HTTP or faults; the worker (``worker.py``) adds those around them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from app.contract.refusal_codes import context_length_message
from app.worker.protocol import AttemptSpec, Code, Refusal


@dataclass(frozen=True, slots=True)
class ToolCallOutput:
    """A choice's whole tool call; ``streamed``: its pieces went out before it, as token
    frames under ``tool_calls`` (app/worker/vllm_parsing.py)."""

    index: int
    tool_call_id: str
    name: str
    arguments: str
    streamed: bool = False


class EngineOutput:
    """New output of one choice: token ids and their text, and the finish reason once done.

    ``key`` names the delta field the text goes under when it is not the content: a
    reasoning parser's ``reasoning`` (app/worker/vllm_parsing.py). ``stop_reason``: with the
    finish, the stop string or token id that ended the choice, as vLLM says it."""

    __slots__ = (
        "answer",
        "choice",
        "finish_reason",
        "key",
        "logprobs",
        "prompt",
        "prompt_logprobs",
        "stop_reason",
        "text",
        "token_ids",
        "tool_call",
    )

    def __init__(
        self,
        choice: int,
        token_ids: list[int],
        text: str,
        finish_reason: str | None = None,
        tool_call: ToolCallOutput | None = None,
        logprobs: list[Any] | None = None,  # asked for: one [token, logprob, alternatives] per token id
        key: str | None = None,  # None: the content
        stop_reason: str | int | None = None,
    ) -> None:
        self.choice = choice
        self.token_ids = token_ids
        self.text = text
        self.finish_reason = finish_reason
        self.tool_call = tool_call
        self.logprobs = logprobs
        self.key = key
        self.stop_reason = stop_reason
        # with a choice's first delta, what vLLM's server says of the prompt there, where asked
        # (its token ids, its rendered text: app/worker/vllm_requests.py)
        self.prompt: tuple[list[int] | None, str | None] | None = None
        # with a choice's first output, the prompt's log probabilities, where the start asked
        # (AttemptSpec.prompt_logprobs): per prompt token None or [[id, logprob, rank, text], …]
        self.prompt_logprobs: list[Any] | None = None
        # a pooling request's whole answer, with its finish (docs/design.md §17)
        self.answer: PooledOutput | None = None


@dataclass(frozen=True, slots=True)
class PooledOutput:
    """A pooling request's answer as vLLM's server gives it: a JSON value, or the bytes of
    an embedding's ``bytes`` formats, and the headers that go with it (``metadata``)."""

    value: Any
    headers: dict[str, str]


@dataclass(frozen=True, slots=True)
class Prepared:
    """A request the engine accepted: its prompt length and whatever the engine needs."""

    spec: AttemptSpec
    prompt_tokens: int
    payload: Any = None
    # the usage's other fields once generated (a reasoning parser's completion_tokens_details)
    usage_details: Callable[[], dict[str, Any] | None] | None = None
    each_prompt: tuple[int, ...] = ()  # a batch's: each prompt's tokens (empty: one prompt)

    def prompt_tokens_of(self, choice: int) -> int:
        """The tokens of the prompt that ``choice`` answers, as vLLM's server counts them in
        that choice's usage (a batch's prompt k answers choices k·n … k·n + n − 1)."""
        if not self.each_prompt:
            return self.prompt_tokens
        return self.each_prompt[min(choice // self.spec.sampling.n, len(self.each_prompt) - 1)]


class EngineFailed(Exception):
    """The engine could not serve a request it had accepted (becomes an engine_error frame)."""


class Engine(Protocol):
    """What the worker needs from an engine."""

    name: str
    models: tuple[str, ...]
    # whether it generates: False for a pooling model's engine, which serves pooling
    # attempts only (its health probe is a pooling request: app/worker/health.py)
    generates: bool

    async def start(self) -> None:
        """Load the model; the worker is ready once this returns."""

    async def close(self) -> None:
        """Stop the engine and any processes it started."""

    async def prepare(self, spec: AttemptSpec) -> Prepared:
        """Render and tokenize the prompt; raise :class:`Refusal` if the engine cannot serve it.
        It may wait (vLLM's pooling servers render in a thread), so the worker admits an
        attempt only once it returns (app/worker/worker.py)."""

    def generate(self, engine_request_id: str, prepared: Prepared) -> AsyncIterator[EngineOutput]:
        """Start generating; the iterator ends after every choice has a finish reason or an abort."""

    async def abort(self, engine_request_id: str) -> int | None:
        """Stop the request; return once the engine confirmed it, with its generated token count if known."""

    def running_requests(self) -> list[str]:
        """The ids of the engine requests it runs now, each beginning with the id the worker
        gave (vLLM adds to it: a batch's prompt, a beam search's steps, its own suffix)."""

    def utility(self, path: str, body: dict[str, Any] | None) -> dict[str, Any]:
        """vLLM's ``tokenize``, ``detokenize`` (``body``) or ``version`` (``body`` None) answer;
        raise :class:`Refusal` for a body it will not serve, or a route it does not."""


def prompt_too_long(prompt_tokens: int, max_model_len: int) -> Refusal:
    """A prompt that leaves the model no room for output, refused in vLLM's words and with
    the code a client gets for it through any replica (app/contract/refusal_codes.py)."""
    message = context_length_message(max_model_len, prompt_tokens)
    return Refusal(400, Code.CONTEXT_LENGTH_EXCEEDED, message, field="input_tokens")
