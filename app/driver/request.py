"""What a client asked for, validated: the driver's input (``app.api.schemas`` builds it)."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

from app.contract.logprobs import as_params
from app.replicas.base import AttemptRequest

CHAT = "chat.completions"
COMPLETIONS = "completions"
AFFINITY_PROMPT_CHARS = 512  # a completion prompt's affinity key: its start, which follow-ups share


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    endpoint: str
    model: str
    stream: bool
    include_usage: bool
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stop: tuple[str, ...] = ()
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    messages: tuple[dict[str, Any], ...] | None = None
    prompt: str | None = None
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
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def guided(self) -> bool:
        formatted = self.response_format is not None and self.response_format.get("type") != "text"
        return formatted or self.structured_outputs is not None

    @property
    def prompt_text(self) -> str:
        if self.prompt is not None:
            return self.prompt
        assert self.messages is not None
        return "\n".join(_content_text(m.get("content")) for m in self.messages)

    @property
    def estimated_prompt_tokens(self) -> int:
        """A tokenizer-free estimate (about four characters a token) for the cost guard."""
        return math.ceil(len(self.prompt_text) / 4)

    def sampling(self) -> dict[str, Any]:
        """The sampling parameters as replicas take them (OpenAI names)."""
        params: dict[str, Any] = {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "n": self.n,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
        }
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
            basis = json.dumps(leading, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        else:
            basis = (self.prompt or "")[:AFFINITY_PROMPT_CHARS]
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
            prompt=self.prompt,
            sampling=self.sampling(),
        )

    def params_digest(self) -> str:
        canonical = json.dumps(self.raw, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def _content_text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(part["text"] for part in content)
    return content or ""
