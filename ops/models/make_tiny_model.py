"""Build a tiny Llama that vLLM can serve, with no download, whose answers are known.

    python ops/models/make_tiny_model.py DIR

writes DIR/{config.json, model.safetensors, tokenizer.json, tokenizer_config.json, …}:
a 2-layer Llama (hidden 128, 4 heads of 32, vocab ~1k, 4096 positions) and a byte-level
BPE tokenizer trained here on the few lines below, plus a chat template that renders
tools and opens a think block. The same command builds the same files.

The weights are not random: the attention and MLP blocks write nothing back (their
output projections are zero), so the logits depend on the last token alone, and the
embeddings and the output head are set so that each token of the cycle
(:data:`REASONING`, ``</think>``, :data:`ANSWER`) is followed by the next one, and any
other token by the first, with a logit margin of ~20 (a top probability within 1e-6 of
1). Whatever the prompt, the model answers the cycle from its start, deterministically
on every engine and dtype: a few words of reasoning, then ``</think>``, then words on
and on (no end of sequence: an answer ends by its length, a stop string or a
constraint). vLLM's ``deepseek_r1`` reasoning parser turns what comes before
``</think>`` into reasoning deltas; ``<think>``, ``</think>``, ``<tool_call>`` and
``</tool_call>`` are added (not special) tokens, as the reasoning and ``hermes``
tool-call parsers need. Structured outputs pick among the tokens they allow: the cycle's next
one where allowed, else the allowed one of lowest id (the others' logits are equal).

Runs in the vLLM environment (needs torch, transformers and tokenizers); the rest of
phasegate does not import it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

SEED = 20261130
HIDDEN = 128
VOCAB_SIZE = 1024
# Long enough for a generation that outlasts a test's cancel (vLLM serves it with
# --max-model-len up to this); the weights do not grow with it.
MAX_POSITIONS = 4096
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
# what the reasoning and tool-call parsers look for: whole tokens, kept in the decoded text
PARSER_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
# The answer to every prompt: reasoning until </think>, then the answer's words, round and
# round. Each piece must be one token of the trained vocabulary, and none may come twice.
REASONING = [" first", " client", " may", " retry", ","]
ANSWER = ["Hello", "!", " the", " quick", " brown", " fox", " jumps", " lazy", " dog", " sleeps", " warm", " sun", "."]
LOGIT_MARGIN = 2.0  # times the normalized hidden state's sqrt(128): a margin of ~22

# Enough text for BPE to learn a few hundred merges; byte-level pieces cover the rest.
CORPUS = [
    "A request may be re-run on another replica only while nothing of it has reached the client.",
    "The boundary is the fact of delivery, not of generation.",
    "Ten tokens computed upstream but not written downstream still allow a retry.",
    "One delta written to the client socket forbids it.",
    "The gateway records the commit point durably before its first write of content.",
    "A cancel sent is not a cancel proven: the source is presumed alive until acknowledged.",
    "The worker checks the lease before every chunk it publishes and stops when it lapses.",
    "Hello! How can I help you today? Tell me about the weather, the sea and the mountains.",
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun.",
    "Once upon a time there was a small model that could count: one, two, three, four, five.",
    "def add(a, b): return a + b  # numbers 0 1 2 3 4 5 6 7 8 9 and {json: [true, false, null]}",
    "Replicas, leases, epochs, attempts, fences and heartbeats make a careful gateway.",
]
WORDS = (  # noqa: SIM905 (a paragraph reads better than 120 quoted words)
    "time person year way day thing man world life hand part child eye woman place work week case "
    "point government company number group problem fact water money story month lot right study book "
    "job word business issue side kind head house service friend father power hour game line end "
    "member law car city community name president team minute idea kid body information back parent "
    "face others level office door health art war history party result change morning reason research "
    "girl guy moment air teacher force education foot boy age policy process music market sense nation"
).split()


def corpus() -> list[str]:
    """The fixed lines plus seeded sentences over a small word list (more merges, ~1k vocab)."""
    import random

    rng = random.Random(SEED)
    lines = list(CORPUS)
    for _ in range(400):
        lines.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14))).capitalize() + ".")
    return lines


CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>tools: {{ tools | tojson }}<|end|>{% endif %}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}{% for part in message['content'] %}{{ part['text'] }}{% endfor %}{% endif %}"
    "{% if message['tool_calls'] %}{% for call in message['tool_calls'] %}"
    "<tool_call>{{ call['function'] | tojson }}</tool_call>{% endfor %}{% endif %}"
    "<|end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is not defined or enable_thinking %}"
    "<think>{% endif %}{% endif %}"
)


def build_tokenizer(out: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in PARSER_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        model_max_length=MAX_POSITIONS,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


def cycle_ids(tokenizer: Any) -> list[int]:
    """The token ids of the cycle: the reasoning pieces, ``</think>``, then the answer's."""
    ids = []
    for piece in [*REASONING, "</think>", *ANSWER]:
        encoded = tokenizer.encode(piece, add_special_tokens=False)
        assert len(encoded) == 1, f"{piece!r} is not one token of the vocabulary: {encoded}"
        ids.append(encoded[0])
    assert len(set(ids)) == len(ids), "a token twice in the cycle: its successor would be ambiguous"
    return ids


def build_model(out: Path, tokenizer: Any) -> list[int]:
    """The weights (see the module docstring); returns the cycle's token ids."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config)
    cycle = cycle_ids(tokenizer)
    assert len(cycle) < HIDDEN, "one hidden dimension per cycle token, and one for every other token"
    with torch.no_grad():
        for param in model.parameters():  # what attention and the MLPs compute is thrown away below
            param.normal_(mean=0.0, std=0.05)
        for layer in model.model.layers:  # ... here: they add nothing to the residual stream
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        other = len(cycle)  # the dimension of every token outside the cycle
        embed = model.model.embed_tokens.weight
        embed.zero_()
        embed[:, other] = 1.0
        head = model.lm_head.weight
        head.zero_()
        for position, token_id in enumerate(cycle):
            embed[token_id, other] = 0.0
            embed[token_id, position] = 1.0
            head[cycle[(position + 1) % len(cycle)], position] = LOGIT_MARGIN  # this token -> the next one
        head[cycle[0], other] = LOGIT_MARGIN  # any other token -> the first
        model.model.norm.weight.fill_(1.0)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    return cycle


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("out", type=Path, help="directory to write the model into")
    args = parser.parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    build_tokenizer(out)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    cycle = build_model(out, tokenizer)
    sample = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False)
    answer = tokenizer.decode(cycle)
    summary = {"dir": str(out), "vocab_size": len(tokenizer), "chat_sample": sample, "answer": answer}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
