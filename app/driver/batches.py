"""A delivery batch: the deltas that one ``DeltasDelivered`` (or, while no client is
attached, one ``DeltasProduced``) will record, gathered as they are written.

The recorder (:mod:`app.driver.recorder`) opens one at a request's first delta after
any other event, adds each delta, and closes it full, aged or cut by another event.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from app.driver.outputs import Delta
from app.store.content import kept_text
from statemachine.deltas import CONTENT, PromptLogprobs, TokenLogprob
from statemachine.events import DeltasDelivered, DeltasProduced, Event


@dataclass(slots=True)
class OpenBatch:
    """Deltas written to the client and not yet recorded, or produced while no client
    was attached (``produced``)."""

    attempt: int
    lease_epoch: int
    from_index: int
    opened_at: float  # monotonic: the batch's age closes it
    first_at: datetime  # wall clock: the event's time
    tokens: int = 0
    texts: list[str] = field(default_factory=list)
    shapes: list[tuple[int, int, int]] = field(default_factory=list)  # per delta: choice, characters, tokens
    produced: bool = False  # recorded as produced, not delivered (no client attached)
    logprobs: list[tuple[TokenLogprob, ...]] | None = None  # per delta, once one carried them
    keys: list[str] | None = None  # per delta, once one was not content (statemachine.deltas: CONTENT …)
    token_ids: list[tuple[int, ...]] | None = None  # per delta, once one carried them
    prompts: list[tuple[int, tuple[int, ...] | None, str | None]] = field(default_factory=list)
    prompt_tokens: list[tuple[int, int]] = field(default_factory=list)  # per choice opened: its prompt's count
    prompt_logprobs: list[tuple[int, PromptLogprobs]] = field(default_factory=list)  # per choice opened, where said

    def add(self, delta: Delta) -> None:
        tokens, text, choice, logprobs, key = delta.tokens, delta.text, delta.choice, delta.logprobs, delta.key
        self.tokens += tokens
        self.texts.append(text)
        self.shapes.append((choice, len(text), tokens))
        if logprobs is not None and self.logprobs is None:  # deltas before it carried none
            self.logprobs = [()] * (len(self.shapes) - 1)
        if self.logprobs is not None:
            self.logprobs.append(logprobs or ())
        # a content delta of no tokens (the rest of a chunk another field took the token of)
        # names its key, since a delta of no tokens is otherwise a choice's tool calls
        if (key != CONTENT or tokens == 0) and self.keys is None:  # deltas before it were content
            self.keys = [CONTENT] * (len(self.shapes) - 1)
        if self.keys is not None:
            self.keys.append(key)
        if delta.token_ids and self.token_ids is None:
            self.token_ids = [()] * (len(self.shapes) - 1)
        if self.token_ids is not None:
            self.token_ids.append(tuple(delta.token_ids))
        if delta.prompt is not None:
            self.prompts.append((choice, *delta.prompt))
        if delta.prompt_tokens is not None:
            self.prompt_tokens.append((choice, delta.prompt_tokens))
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs.append((choice, delta.prompt_logprobs))

    @property
    def deltas(self) -> int:
        return len(self.texts)

    def event(self, content_policy: str) -> tuple[type[Event], dict[str, Any]]:
        """The event that records the batch, and its fields, under ``content_policy``."""
        text, text_sha256 = kept_text("".join(self.texts), content_policy)
        fields: dict[str, Any] = {
            "attempt": self.attempt,
            "lease_epoch": self.lease_epoch,
            "from_index": self.from_index,
            "to_index": self.from_index + len(self.texts),
            "tokens": self.tokens,
            "text": text,
            "text_sha256": text_sha256,
            "deltas": tuple(self.shapes),
            "fields": tuple(self.keys) if self.keys is not None else (),
            "prompt_tokens": tuple(self.prompt_tokens),  # counts, not content: under any policy
        }
        if content_policy == "full":  # with the text only: they are content too (docs/design.md §13)
            fields["logprobs"] = tuple(self.logprobs) if self.logprobs is not None else None
            fields["token_ids"] = tuple(self.token_ids) if self.token_ids is not None else ()
            fields["prompts"] = tuple(self.prompts)
            fields["prompt_logprobs"] = tuple(self.prompt_logprobs)  # decoded prompt tokens: content
        return (DeltasProduced if self.produced else DeltasDelivered), fields
