"""What a client asked for, validated: the driver's input (``app.api.chat.request`` builds it)."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

from app.contract import json_depth as deep_json
from app.contract.logprobs import as_params
from app.contract.request_fields import RECORDED, SET_BY_PHASEGATE
from app.contract.vllm_extras import LEGACY_GUIDED
from app.replicas.base import AttemptRequest

CHAT = "chat.completions"
COMPLETIONS = "completions"
RESPONSES = "responses"  # the Responses API: each attempt a chat completion (docs/design.md §15)
MESSAGES = "messages"  # Anthropic's Messages API: each attempt a chat completion (docs/design.md §17)
NOT_PASSED_ON = RECORDED | SET_BY_PHASEGATE | {"model"}
AFFINITY_PROMPT_CHARS = 512  # a completion prompt's affinity key: its start, which follow-ups share
AFFINITY_PROMPT_TOKENS = 128  # the same, for a prompt of token ids


@dataclass(frozen=True, slots=True)
class ResponsesCall:
    """How a Responses API request was made: the client's body, what its response object
    echoes of it, and whether its output text carries log probabilities."""

    body: dict[str, Any]
    echo: dict[str, Any]
    output_logprobs: bool = False
    background: bool = False  # generated with no client attached (docs/design.md §15)


@dataclass(frozen=True, slots=True)
class MessagesCall:
    """How an Anthropic Messages API request was made: the client's body, and what its
    answer says of it (app/api/messages/request.py)."""

    body: dict[str, Any]
    stop_sequences: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class PoolingCall:
    """A pooling request (docs/design.md §17): no decode, one whole answer. Its ``endpoint``
    is the route's path, on which each attempt asks its replica; ``raw`` is its body."""

    prompt_tokens: int  # exact for token ids, else estimated as a completion's prompt is


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """A request as the client made it. A sampling field the client did not give is
    ``None``: the replica's own default applies (the model's generation config, for vLLM)."""

    endpoint: str
    model: str
    stream: bool
    include_usage: bool
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    prompt: str | None = None  # the text of a completion's prompt (None for token ids)
    prompts: int = 1  # a completion's prompts (a batch): each gets n choices
    tools: tuple[dict[str, Any], ...] = ()
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    user: str | None = None
    ignore_eos: bool = False  # vLLM's extra: generate max_tokens whatever the model says
    # vLLM's other extras (top_k, min_p, repetition_penalty, min_tokens), only those given,
    # and its structured-output constraint (app/contract/vllm_extras.py)
    sampling_extras: dict[str, Any] = field(default_factory=dict)
    structured_outputs: dict[str, Any] | None = None
    logprobs: int | None = None  # alternatives wanted at each token; None: no log probabilities
    metadata: dict[str, str] | None = None  # recorded in the log, not acted on
    return_token_ids: bool = False  # vLLM's extra: each delta's token ids, and the prompt's, go to the client
    # the usage so far in every chunk (``stream_options``: ``continuous_usage_stats`` with
    # ``include_usage``, as vLLM reads them): the replica is asked for the prompt's count
    continuous_usage: bool = False
    # the prompt's log probabilities a whole answer carries (vLLM's ``prompt_logprobs``, or an
    # echo's: app/contract/logprobs.py): alternatives at each prompt token; None: none
    prompt_logprobs: int | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)  # the client's body
    # a Responses API request (app/api/responses/request.py): its attempts are the chat
    # completion ``raw`` holds
    responses: ResponsesCall | None = field(default=None, compare=False, repr=False)
    # an Anthropic Messages API request (app/api/messages/request.py): the same, in that API's words
    anthropic: MessagesCall | None = field(default=None, compare=False, repr=False)
    # a pooling request (app/api/pooling/request.py): its endpoint is its route's path
    pooling: PoolingCall | None = field(default=None, compare=False, repr=False)

    @property
    def logged_endpoint(self) -> str:
        """The API the client called, as the log records it."""
        if self.anthropic is not None:
            return MESSAGES
        return RESPONSES if self.responses is not None else self.endpoint

    @property
    def background(self) -> bool:
        """A background response (docs/design.md §15): no client is attached to it from its accept on."""
        return self.responses is not None and self.responses.background

    @property
    def stored(self) -> bool:
        """Its content may be kept (a Responses request's ``store: false`` says not: the
        log keeps digests of it at most, docs/design.md §15)."""
        return self.responses is None or self.responses.body.get("store") is not False

    @property
    def client_body(self) -> dict[str, Any]:
        """The body the client sent, as the log records its input."""
        if self.anthropic is not None:
            return self.anthropic.body
        return self.responses.body if self.responses is not None else self.raw

    @property
    def choices(self) -> int:
        """The answer's choices: ``n`` for each prompt."""
        return self.n * self.prompts

    @property
    def response_role(self) -> str:
        """The answer's role, as vLLM gives it: the assistant's, or, where the client asked
        for no generation prompt, the role of the message it continues."""
        if self.messages and self.raw.get("add_generation_prompt") is False:
            return str(self.messages[-1].get("role") or "assistant")
        return "assistant"

    @property
    def guided(self) -> bool:
        formatted = self.response_format is not None and self.response_format.get("type") != "text"
        return formatted or self.structured_outputs is not None

    @property
    def prompt_text(self) -> str:
        if self.prompt is not None:
            return self.prompt
        if self.messages is None:  # token ids, or a batch of prompts
            prompt = self.raw.get("prompt")
            texts = [p for p in prompt if isinstance(p, str)] if isinstance(prompt, list) else []
            return "\n".join(texts)
        return "\n".join(_content_text(m.get("content")) for m in self.messages)

    @property
    def estimated_prompt_tokens(self) -> int:
        """Exact for token ids; else a tokenizer-free estimate (about four characters a
        token) for the cost guard."""
        if self.pooling is not None:
            return self.pooling.prompt_tokens
        prompt = self.raw.get("prompt") if self.messages is None else None
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], str):
            return sum(len(ids) for ids in prompt) if isinstance(prompt[0], list) else len(prompt)
        return math.ceil(len(self.prompt_text) / 4)

    def passed_on(self) -> dict[str, Any]:
        """The client's fields for an OpenAI-compatible replica, as it sent them: all but
        what phasegate sets itself (the stream, the model of the attempt) and what it only
        records (app/contract/request_fields.py). An older guided-decoding field, which
        vLLM 0.32 ignores, goes as the ``structured_outputs`` it means; where the client
        gave no ``max_tokens``, the operator's default, when one is set."""
        passed = {k: v for k, v in self.raw.items() if k not in NOT_PASSED_ON}
        asked = passed.get("max_tokens") is not None or passed.get("max_completion_tokens") is not None
        if self.max_tokens is not None and not asked:
            passed["max_tokens"] = self.max_tokens  # the operator's default (limits.default_max_tokens)
        if self.structured_outputs is not None and any(name in passed for name in LEGACY_GUIDED):
            for name in LEGACY_GUIDED:
                passed.pop(name, None)
            passed["structured_outputs"] = self.structured_outputs
        return passed

    def sampling(self) -> dict[str, Any]:
        """The sampling parameters as replicas take them (OpenAI names): only those given."""
        params: dict[str, Any] = {"n": self.n}
        for name in ("max_tokens", "temperature", "top_p", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value is not None:
                params[name] = value
        if self.stop:
            params["stop"] = list(self.stop)
        if self.seed is not None:
            params["seed"] = self.seed
        if self.tools:
            params["tools"] = list(self.tools)
        if self.tool_choice is not None:
            params["tool_choice"] = self.tool_choice
        if self.response_format is not None:
            params["response_format"] = self.response_format
        if self.ignore_eos:
            params["ignore_eos"] = True
        params.update(self.sampling_extras)
        if self.structured_outputs is not None:
            params["structured_outputs"] = self.structured_outputs
        params.update(as_params(self.logprobs, chat=self.endpoint == CHAT))
        return params

    def affinity_key(self) -> str:
        """What ties the turns of one conversation together, for prefix affinity: the
        client's ``user`` when given, else its leading messages (the system prompt and
        the first user turn, which every later turn repeats) or a completion prompt's
        start. A digest: the log never holds the text for it."""
        if self.user:
            basis = "user:" + self.user
        elif self.messages is not None:
            leading: list[dict[str, Any]] = []
            for message in self.messages:
                leading.append(message)
                if message.get("role") == "user":
                    break
            basis = deep_json.dumps(leading, sort_keys=True)
        else:  # a completion: its prompt's start (a batch's first prompt), as text or token ids
            prompt = self.raw.get("prompt", self.prompt)
            first = prompt[0] if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list) else prompt
            if isinstance(first, list):
                basis = "ids:" + json.dumps(first[:AFFINITY_PROMPT_TOKENS], separators=(",", ":"))
            else:
                basis = (first if isinstance(first, str) else "")[:AFFINITY_PROMPT_CHARS]
        return hashlib.sha256(basis.encode()).hexdigest()[:16]

    def for_attempt(
        self, request_id: str, attempt: int, *, lease_ttl_s: float, model: str | None = None
    ) -> AttemptRequest:
        """What attempt ``attempt`` asks of its replica (its lease epoch is its number),
        of ``model`` when a fallback's."""
        return AttemptRequest(
            request_id=request_id,
            attempt=attempt,
            lease_epoch=attempt,
            lease_ttl_s=lease_ttl_s,
            endpoint=self.endpoint,
            model=model or self.model,
            messages=self.messages,
            prompt=self.raw.get("prompt") if self.messages is None else None,
            sampling=self.sampling(),
            passed=self.passed_on(),
            choices=self.choices,
            continuous_usage=self.continuous_usage,
            prompt_logprobs=self.prompt_logprobs,
        )

    def params_digest(self) -> str:
        """The digest of the body the client sent (a response's own, not its chat completion's)."""
        canonical = deep_json.dumps(self.client_body, sort_keys=True)
        return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def _content_text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(part["text"] for part in content)
    return content or ""
