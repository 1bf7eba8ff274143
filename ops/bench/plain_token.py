"""What an OpenAI upstream's token event costs the gateway to read, by path.

    python -m ops.bench.plain_token [--number 200000]

A vLLM 0.32 chat chunk of one token (its exact bytes: ``token_ids`` and ``logprobs`` null,
as ``vllm serve`` sends them), read three ways side by side: by the stream's learned
template (``_Template.token``: the bytes around the text), by ``_plain_token`` (parsed,
then checked to carry nothing but the text: every other field null), and in full
(``parse_chunk`` and the delta's pieces, what the frames do for any other event, a
reasoning delta or a chunk with token ids). Prints microseconds an event.
"""

from __future__ import annotations

import argparse
import timeit

from app.replicas.openai_chunks import delta_pieces, parse_chunk
from app.replicas.openai_stream import _plain_token, _Template

EVENT = (
    b'data: {"id":"chatcmpl-8275d93a9c433c1d","object":"chat.completion.chunk","created":1796324087,'
    b'"model":"tiny-llama","choices":[{"index":0,"delta":{"content":" quick"},"logprobs":null,'
    b'"finish_reason":null,"token_ids":null}]}'
)
REASONING = EVENT.replace(b'"content"', b'"reasoning"')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--number", type=int, default=200_000)
    n = parser.parse_args().number
    token = _plain_token(EVENT, 0)
    assert token is not None and token.text == " quick" and _plain_token(REASONING, 0) is None
    template = _Template.learned(EVENT, token)
    assert template is not None and template.token(EVENT, 1) is not None

    def full(event: bytes) -> None:
        for choice in parse_chunk(event[5:])["choices"]:
            delta_pieces(choice["delta"])

    paths = {
        "template": lambda: template.token(EVENT, 1),
        "plain_token": lambda: _plain_token(EVENT, 1),
        "full parse (content)": lambda: full(EVENT),
        "full parse (reasoning)": lambda: full(REASONING),
    }
    for name, call in paths.items():
        best = min(timeit.repeat(call, number=n, repeat=5)) / n
        print(f"{name:24} {best * 1e6:6.2f} µs an event")


if __name__ == "__main__":
    main()
