"""Build a tiny random-weight Llama that vLLM can serve, with no download.

    python ops/models/make_tiny_model.py DIR

writes DIR/{config.json, model.safetensors, tokenizer.json, tokenizer_config.json, …}:
a 2-layer Llama (hidden 128, 4 heads of 32, vocab ~1k, 4096 positions) with seeded random weights and
a byte-level BPE tokenizer trained here on the few lines below, plus a chat template
(tools are rendered when given). The same command builds the same files: the weights
come from a fixed torch seed and BPE training on fixed text is deterministic.

Runs in the vLLM environment (needs torch, transformers and tokenizers); the rest of
phasegate does not import it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SEED = 20261130
VOCAB_SIZE = 1024
# Long enough for a generation that outlasts a test's cancel (vLLM serves it with
# --max-model-len up to this); the weights do not grow with it.
MAX_POSITIONS = 4096
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]

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
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
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
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        model_max_length=MAX_POSITIONS,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


def build_model(out: Path, vocab_size: int, bos_id: int, eos_id: int, pad_id: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(mean=0.0, std=0.05)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("out", type=Path, help="directory to write the model into")
    args = parser.parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    build_tokenizer(out)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    build_model(
        out,
        vocab_size=len(tokenizer),
        bos_id=tokenizer.bos_token_id,
        eos_id=tokenizer.eos_token_id,
        pad_id=tokenizer.pad_token_id,
    )
    sample = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False)
    summary = {"dir": str(out), "vocab_size": len(tokenizer), "chat_sample": sample}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
