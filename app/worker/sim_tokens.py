"""The sim engine's vocabulary (app/worker/sim.py), and its log probabilities: a generated
token's, a function of its id; a prompt's (its words the sim's prompt tokens), of each word."""

from __future__ import annotations

import hashlib
from typing import Any

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
VOCAB_SIZE = 1000


def _word(token_id: int) -> str:
    syllables = []
    n = token_id + 1
    while n:
        n, r = divmod(n, len(_CONSONANTS) * len(_VOWELS))
        syllables.append(_CONSONANTS[r // len(_VOWELS)] + _VOWELS[r % len(_VOWELS)])
    return "".join(syllables)


VOCAB = tuple(" " + _word(i) for i in range(VOCAB_SIZE))


def token_logprob(token_id: int, text: str, top: int) -> list[Any]:
    """A token's log probability, a function of its id, and ``top`` alternatives, best first
    (the token itself first: the sim always picks its most likely token)."""
    logprob = -round(0.01 + (token_id * 7919 % 1000) / 400, 4)
    alternatives = [[text, logprob]] + [
        [VOCAB[(token_id + 37 * j) % VOCAB_SIZE], round(logprob - 0.5 * j, 4)] for j in range(1, top)
    ]
    return [text, logprob, alternatives[:top]]


def prompt_logprobs(prompt: str, top: int) -> list[Any]:
    """A prompt's log probabilities as vLLM gives them, a function of its words (the sim's
    prompt tokens): none for the first; at each other, the word (an id from its digest,
    its log probability and rank from the id), then ``top`` alternatives of the vocabulary,
    ranked 1, 2, … (vLLM's order: the prompt's token first)."""
    said: list[Any] = []
    for place, word in enumerate(prompt.split() or [prompt]):
        if not place:
            said.append(None)
            continue
        token_id = int.from_bytes(hashlib.sha256(word.encode()).digest()[:4], "big") % VOCAB_SIZE
        chosen = [token_id, -round(0.01 + (token_id * 7919 % 1000) / 400, 4), 1 + token_id % 7, " " + word]
        alternatives = [
            [(token_id + 37 * j) % VOCAB_SIZE, -round(0.05 * j, 4), j, VOCAB[(token_id + 37 * j) % VOCAB_SIZE]]
            for j in range(1, top + 1)
        ]
        said.append([chosen, *alternatives])
    return said
