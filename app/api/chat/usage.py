"""The usage so far that a chat completion's or completion's stream carries in every chunk
where the client asked (``stream_options.continuous_usage_stats``, with ``include_usage``),
as vLLM's server sends it (docs/compatibility.md): per choice, the prompt's tokens as the
replica counted them and the tokens of the choice's deltas up to the chunk.

Both counts come from what the stream sent, which is the log's (docs/design.md §12): the
prompt's count was said with the choice's first delta (``DeltasDelivered.prompt_tokens``),
and each delta's tokens are recorded with it, so a resumed reader, told the deltas it had
(``count``), gets chunks with the same usage. Where the replica said no count (one that does
not send it) the gateway's estimate stands in, the one its ``RequestAccepted`` records.
"""

from __future__ import annotations

from typing import Any

from app.driver.request import GenerationRequest

# the fields of vLLM's ``UsageInfo``, in its order
_ORDER = ("prompt_tokens", "total_tokens", "completion_tokens", "prompt_tokens_details", "completion_tokens_details")


def in_order(usage: dict[str, Any]) -> dict[str, Any]:
    """The usage at the stream's end in one order whether it comes from the replica or the
    log (PostgreSQL's ``jsonb`` keeps no order of keys): vLLM's fields in vLLM's order, any
    other after them, and the keys of what they hold sorted."""
    known = [name for name in _ORDER if name in usage]
    return {name: _sorted(usage[name]) for name in (*known, *sorted(usage.keys() - set(known)))}


def _sorted(value: Any) -> Any:
    return {key: _sorted(value[key]) for key in sorted(value)} if isinstance(value, dict) else value


class UsageSoFar:
    """Per choice, its prompt's tokens and the tokens of its deltas so far, and the
    ``usage`` member of its next chunk."""

    __slots__ = ("_completed", "_prompt_tokens", "estimate", "request")

    def __init__(self, request: GenerationRequest) -> None:
        self.request = request
        self.estimate: int | None = None  # the gateway's, where the replica said none (read once)
        self._prompt_tokens: dict[int, int] = {}  # per choice, as the replica said
        self._completed: dict[int, int] = {}  # per choice: the tokens of its deltas so far

    def said(self, choice: int, prompt_tokens: int | None) -> None:
        """What the replica said of ``choice``'s prompt with its first delta, if it said it."""
        if prompt_tokens is not None:
            self._prompt_tokens[choice] = prompt_tokens

    def count(self, choice: int, tokens: int, prompt_tokens: int | None = None) -> None:
        """A delta of ``choice`` went (or had gone, before a resumed reader's): its tokens count."""
        self._completed[choice] = self._completed.get(choice, 0) + tokens
        self.said(choice, prompt_tokens)

    def member(self, choice: int, completed: int | None = None) -> str:
        """The chunk's ``usage`` member (led by a comma) for ``choice``: its deltas' tokens
        so far, or ``completed`` where given (the replica's count at a finish)."""
        prompt = self._prompt_tokens.get(choice)
        if prompt is None:
            if self.estimate is None:
                self.estimate = self.request.estimated_prompt_tokens
            prompt = self.estimate
        done = self._completed.get(choice, 0) if completed is None else completed
        return f',"usage":{{"prompt_tokens":{prompt},"total_tokens":{prompt + done},"completion_tokens":{done}}}'
