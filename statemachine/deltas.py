"""What one delta of an answer holds, in the log's words (docs/design.md §3, §14): the field of
the client's delta that carried its text, its tokens' log probabilities, their ids, and
what the replica said of the prompt before a choice's first delta (its text and ids, its
token count)."""

from __future__ import annotations

# A token's log probability and the likeliest tokens at its place:
# (token, logprob, ((alternative, logprob), …)); per delta, its tokens' in order. An echoed
# prompt's first token has none: (token, None, ()), as vLLM gives it (null). A token sent
# under another name than its text (vLLM's ``return_tokens_as_token_ids``: ``token_id:<id>``)
# carries its text fourth, since a chat client's ``bytes`` are the text's:
# (token, logprob, alternatives, text).
TokenLogprob = (
    tuple[str, float | None, tuple[tuple[str, float], ...]]
    | tuple[str, float | None, tuple[tuple[str, float], ...], str]
)
DeltaLogprobs = tuple[tuple[TokenLogprob, ...], ...]


# The field of a client's delta that carries a delta's text (docs/design.md §14): its content;
# reasoning, under the name the replica gave it (vLLM 0.32 says "reasoning", earlier ones
# "reasoning_content"); a choice's tool calls (their JSON, no tokens). Any other field a
# replica streams as text is passed through under its own name.
CONTENT = "content"
TOOL_CALLS = "tool_calls"
NO_TEXT = ""  # a token whose chat delta carries no text field (``delta: {}``), only its logprobs
REASONING_FIELDS = frozenset({"reasoning", "reasoning_content"})

# Per delta, the ids of its tokens, where the client asked for them (vLLM's
# ``return_token_ids``): the ids the replica sent with the delta, in order.
DeltaTokenIds = tuple[tuple[int, ...], ...]

# What the replica said of a choice's prompt before the choice's first delta, where the
# client asked (``return_token_ids``, a completion's ``echo``; ``return_prompt_text``): the
# prompt's token ids and its rendered text, each ``None`` where not said.
Prompt = tuple[tuple[int, ...] | None, str | None]
# per choice opened in a batch that was said one: (choice, token ids, text)
ChoicePrompts = tuple[tuple[int, tuple[int, ...] | None, str | None], ...]

# The prompt's tokens as the replica counted them (vLLM's ``usage.prompt_tokens``), said
# before a choice's first delta where the client asked for the usage in every chunk
# (``stream_options.continuous_usage_stats``): per choice opened in a batch that was said
# one, (choice, tokens). A batch's prompts each count their own.
ChoicePromptTokens = tuple[tuple[int, int], ...]

# The prompt's log probabilities, where the client asked (vLLM's ``prompt_logprobs``, a
# whole answer's; a chat echo's or a completion's echo with ``logprobs`` ask by default),
# as vLLM's server gives them: per prompt token, ``None`` for the first (nothing came
# before it), else the token and the likeliest at its place, each (token id, logprob,
# rank, decoded text), in vLLM's order. Said before a choice's first delta: per choice
# opened in a batch that was said one, (choice, its prompt's).
PromptTokenLogprob = tuple[int, float, int | None, str | None]
PromptLogprobs = tuple[tuple[PromptTokenLogprob, ...] | None, ...]
ChoicePromptLogprobs = tuple[tuple[int, PromptLogprobs], ...]
