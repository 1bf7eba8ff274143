"""The sim engine's pooling answers (docs/design.md §17): deterministic vectors, shaped as
vLLM 0.32's pooling server shapes each route's answer.

A vector is a pure function of the model and of what is pooled (a text, or token ids), so
every replica gives the same answer to the same request and a retried request's answer is
the one its first attempt would have given; fault tests need no vLLM. Tokens are counted as
the sim counts a prompt's: one a word, or one a token id. A score is the cosine of the
two sides' vectors; a classification's probabilities are a softmax over the first
:data:`CLASSES` components. ``encoding_format`` ``base64`` and ``bytes``/``bytes_only`` are
little-endian float32 as vLLM writes them with ``embed_dtype: float32``; other dtypes and
a big-endian order are refused, as what the sim does not model.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import struct
from typing import Any

DIMENSIONS = 16  # the sim model's hidden size
CLASSES = 2  # the sim classifier's labels: LABEL_0, LABEL_1
SCORE_PAIRS = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"))


class PoolingRefused(ValueError):
    """A request the sim refuses as vLLM would (400), naming the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def vector(model: str, item: str | list[int], dimensions: int | None = None) -> list[float]:
    """The unit vector of ``item`` (a text or token ids), cut to ``dimensions`` and normalized
    again; float32 values, so that its JSON and its base64 say the same."""
    seed = json.dumps([model, item], separators=(",", ":")).encode()
    raw = hashlib.sha256(seed).digest() + hashlib.sha256(seed + b"\1").digest()
    values = [(raw[i] - 127.5) / 127.5 for i in range(DIMENSIONS)][: dimensions or DIMENSIONS]
    norm = math.sqrt(sum(v * v for v in values)) or 1.0
    return list(struct.unpack(f"<{len(values)}f", struct.pack(f"<{len(values)}f", *(v / norm for v in values))))


def tokens(item: str | list[int]) -> int:
    return len(item) if isinstance(item, list) else max(1, len(item.split()))


def answer(path: str, body: dict[str, Any], model: str, request_id: str, created: int) -> tuple[Any, dict[str, str]]:
    """The answer to ``body`` on the pooling route ``path``: a JSON value (or bytes, for an
    embedding's ``bytes`` formats) and the headers that go with it."""
    if path == "/v2/embed":
        return _cohere(body, model, request_id)
    if path in ("/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank"):
        return _scores(path, body, model, request_id, created), {}
    items = _items(body)
    dimensions = body.get("dimensions")
    if dimensions is not None and dimensions > DIMENSIONS:
        raise PoolingRefused("dimensions", f"dimensions must be at most {DIMENSIONS} for this model")
    vectors = [vector(model, item, dimensions) for item in items]
    prompt = sum(tokens(item) for item in items)
    usage = {"prompt_tokens": prompt, "total_tokens": prompt, "completion_tokens": 0, "prompt_tokens_details": None}
    if path == "/classify":
        data = [_classified(index, values) for index, values in enumerate(vectors)]
        return {"id": f"classify-{request_id}", "object": "list", "created": created, "model": model} | {
            "data": data,
            "usage": usage,
        }, {}
    kind, field, prefix = ("pooling", "data", "pool") if path == "/pooling" else ("embedding", "embedding", "embd")
    encoding = body.get("encoding_format") or "float"
    if encoding != "float" and (body.get("embed_dtype", "float32") != "float32" or body.get("endianness") == "big"):
        raise PoolingRefused("embed_dtype", "the sim engine writes float32, little-endian, only")
    whole = {"id": f"{prefix}-{request_id}", "object": "list", "created": created, "model": model}
    if encoding in ("bytes", "bytes_only"):
        packed = [struct.pack(f"<{len(values)}f", *values) for values in vectors]
        offsets = [sum(len(p) for p in packed[:index]) for index in range(len(packed) + 1)]
        metadata = [
            {"index": i, "embed_dtype": "float32", "endianness": "little", "start": offsets[i], "end": offsets[i + 1]}
            | {"shape": [len(values)]}
            for i, values in enumerate(vectors)
        ]
        headers = (
            {} if encoding == "bytes_only" else {"metadata": json.dumps(whole | {"data": metadata, "usage": usage})}
        )
        return b"".join(packed), headers
    encode = _base64 if encoding == "base64" else (lambda values: values)
    data = [{"index": i, "object": kind, field: encode(values)} for i, values in enumerate(vectors)]
    return whole | {"data": data, "usage": usage}, {}


def _base64(values: list[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode()


def _classified(index: int, values: list[float]) -> dict[str, Any]:
    exps = [math.exp(v) for v in values[:CLASSES]]
    probs = [e / sum(exps) for e in exps]
    label = max(range(CLASSES), key=lambda i: probs[i])
    return {"index": index, "label": f"LABEL_{label}", "probs": probs, "num_classes": CLASSES}


def _items(body: dict[str, Any]) -> list[str | list[int]]:
    """What a body asks to pool, one item each: a text, token ids, or a chat (its text)."""
    given = body.get("messages", body.get("input"))
    if isinstance(given, str):
        return [given]
    if not isinstance(given, list) or not given:
        raise PoolingRefused("input", "input must not be empty")
    if all(isinstance(item, int) for item in given):
        return [list(given)]
    if all(isinstance(item, dict) for item in given):  # one chat
        return [_chat(given)]
    if all(isinstance(item, list) and item and isinstance(item[0], dict) for item in given):  # a batch of chats
        return [_chat(chat) for chat in given]
    return [item if isinstance(item, str) else list(item) for item in given]


def _chat(messages: list[dict[str, Any]]) -> str:
    return "\n".join(f"{m.get('role')}: {_text(m.get('content'), 'messages')}" for m in messages)


def _text(content: Any, param: str) -> str:
    """The text of a message's or a score input's content: a string, or its parts' texts."""
    if isinstance(content, list):
        texts = [part.get("text", "") for part in content if isinstance(part, dict)]
        if not all(isinstance(text, str) for text in texts):  # vLLM's own models refuse it too
            raise PoolingRefused(param, "a content part's text must be a string")
        return "".join(texts)
    return content if isinstance(content, str) else ""


def _score_text(item: Any, param: str) -> str:
    if isinstance(item, str):
        return item
    if not isinstance(item, dict):
        raise PoolingRefused(param, "must be a string or an object with 'content'")
    return _text(item.get("content"), param)


def _cosine(a: list[float], b: list[float]) -> float:
    return round(sum(x * y for x, y in zip(a, b, strict=True)), 6)


def _scores(path: str, body: dict[str, Any], model: str, request_id: str, created: int) -> dict[str, Any]:
    if path.endswith("rerank"):
        first, second = "query", "documents"
    else:
        first, second = next(
            pair for pair in SCORE_PAIRS if body.get(pair[0]) is not None and body.get(pair[1]) is not None
        )
    left, right = body[first], body[second]
    left = left if isinstance(left, list) else [left]
    right = right if isinstance(right, list) else [right]
    if len(left) != 1 and len(left) != len(right):
        raise PoolingRefused("queries", "the two sides must be one to many, or as many as each other")
    pairs = [(left[0] if len(left) == 1 else left[i], doc) for i, doc in enumerate(right)]
    texts = [(_score_text(a, first), _score_text(b, second)) for a, b in pairs]
    scores = [_cosine(vector(model, a), vector(model, b)) for a, b in texts]
    prompt = sum(tokens(a) + tokens(b) for a, b in texts)
    if not path.endswith("rerank"):
        data = [{"index": i, "object": "score", "score": score} for i, score in enumerate(scores)]
        usage = {"prompt_tokens": prompt, "total_tokens": prompt, "completion_tokens": 0, "prompt_tokens_details": None}
        return {"id": f"score-{request_id}", "object": "list", "created": created, "model": model} | {
            "data": data,
            "usage": usage,
        }
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    top = body.get("top_n") or len(order)
    results = [
        {"index": i, "document": {"text": texts[i][1], "multi_modal": None}, "relevance_score": scores[i]}
        for i in order[:top]
    ]
    return {
        "id": f"rerank-{request_id}",
        "model": model,
        "usage": {"prompt_tokens": prompt, "total_tokens": prompt},
    } | {"results": results}


def _cohere(body: dict[str, Any], model: str, request_id: str) -> tuple[Any, dict[str, str]]:
    texts = body.get("texts")
    if not texts:
        raise PoolingRefused("texts", "the sim engine embeds texts only")
    dimensions = body.get("output_dimension")
    if dimensions is not None and dimensions > DIMENSIONS:
        raise PoolingRefused("output_dimension", f"output_dimension must be at most {DIMENSIONS} for this model")
    vectors = [vector(model, text, dimensions) for text in texts]
    embeddings: dict[str, Any] = {}
    for kind in body.get("embedding_types") or ["float"]:
        if kind == "float":
            embeddings["float"] = vectors
        elif kind == "base64":
            embeddings["base64"] = [_base64(values) for values in vectors]
        else:
            raise PoolingRefused("embedding_types", f"the sim engine does not write '{kind}' embeddings")
    prompt = sum(tokens(text) for text in texts)
    meta = {"api_version": {"version": "2"}, "billed_units": {"input_tokens": prompt, "image_tokens": None}}
    return {
        "id": f"embd-{request_id}",
        "embeddings": embeddings,
        "texts": texts,
        "meta": meta,
        "response_type": "embeddings_by_type",
    }, {}


def prompt_tokens(value: Any, headers: dict[str, str]) -> int:
    """The prompt tokens an answer states (its ``usage``, Cohere's ``billed_units``, or a
    bytes answer's ``metadata``; 0 for ``bytes_only``, which states none)."""
    said = json.loads(headers["metadata"]) if isinstance(value, bytes) and "metadata" in headers else value
    if not isinstance(said, dict):
        return 0
    usage = said.get("usage") or {"prompt_tokens": said.get("meta", {}).get("billed_units", {}).get("input_tokens")}
    return int(usage.get("prompt_tokens") or 0)
