"""What a batch of deltas must look like, whether delivered or only produced.

The fold (:mod:`statemachine.state`) asks :func:`batch_problem` of every
``DeltasDelivered`` and ``DeltasProduced`` and refuses the event with the reason it
names: the batch follows the last one without a gap, holds at least one delta, and its
per-delta shapes add up to its indexes, tokens and text.
"""

from __future__ import annotations

from statemachine.deltas import CONTENT, NO_TEXT, TOOL_CALLS
from statemachine.events import DeltasDelivered, DeltasProduced


def delta_keys(event: DeltasDelivered | DeltasProduced) -> tuple[str, ...]:
    """Per delta of the batch, the key of the client's delta that carried its text: as
    recorded (``fields``), or, in a batch that records none (all content, or a log written
    before), a choice's tool calls for a delta of no tokens and content for the others."""
    if event.fields:
        return event.fields
    return tuple(TOOL_CALLS if tokens == 0 else CONTENT for _, _, tokens in event.deltas)


def batch_problem(event: DeltasDelivered | DeltasProduced, *, follows: int) -> str | None:
    """Why the batch cannot follow delta ``follows``, or ``None`` when it can."""
    if event.from_index != follows or event.to_index <= event.from_index:
        return f"deltas [{event.from_index}, {event.to_index}) do not follow delta {follows}"
    if event.tokens < 0:
        return "negative token count"
    if event.deltas and (
        len(event.deltas) != event.to_index - event.from_index
        or sum(tokens for _, _, tokens in event.deltas) != event.tokens
        or (event.text is not None and sum(chars for _, chars, _ in event.deltas) != len(event.text))
    ):
        return "the deltas' shapes disagree with the indexes, the tokens or the text"
    if event.fields and (
        len(event.fields) != event.to_index - event.from_index
        or any(key == NO_TEXT and shape[1] for key, shape in zip(event.fields, event.deltas, strict=False))
    ):
        return "the deltas' keys disagree with the indexes or the text"
    count = event.to_index - event.from_index
    if event.logprobs is not None and (event.text is None or len(event.logprobs) != count):
        return "log probabilities are kept with the text, one entry per delta"
    if event.token_ids and (event.text is None or len(event.token_ids) != count):
        return "token ids are kept with the text, one entry per delta"
    if event.prompts and (event.text is None or len({choice for choice, _, _ in event.prompts}) != len(event.prompts)):
        return "a prompt's token ids and text are kept with the text, once per choice"
    return None
