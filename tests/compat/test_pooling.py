"""Pooling requests against ``vllm serve`` serving a pooling model (docs/design.md §17): the
tiny model with vLLM's embedding conversion (``--convert embed``), one more ``vllm serve``
process of this module, and a phasegate gateway in front of it as an ``openai`` replica. The
same request goes to both, and what a client gets is compared (tests/compat/compare.py: ids
and creation times set aside); the real clients (the ``openai`` SDK's ``embeddings.create``,
langchain's ``OpenAIEmbeddings``) against both.

The converted model serves embeddings, pooling, score and rerank (the cosine of the two
sides' embeddings); classify needs a classification head the tiny model does not have, so
its answer is tested against the sim engine's (tests/app/api/test_pooling.py) and here only
for refusing as vLLM refuses it.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from app.config import ReplicaConfig
from tests.compat.compare import ask, differences
from tests.support.gateway import RunningGateway, running_gateway
from tests.support.workers import running_vllm_openai_server, vllm_env

# its own vllm serve (an embedding model): a unit of its own, beside the shared vLLM group
pytestmark = [pytest.mark.vllm, pytest.mark.vllm_subprocess]

MODEL = "tiny-embed"
CASES: dict[str, tuple[str, dict[str, object]]] = {
    "embeddings, a string": ("/v1/embeddings", {"input": "hello world"}),
    "embeddings, a batch": ("/v1/embeddings", {"input": ["hello", "a longer text here"]}),
    "embeddings, token ids": ("/v1/embeddings", {"input": [[1, 2, 3], [4, 5]]}),
    "embeddings, base64": ("/v1/embeddings", {"input": "hello", "encoding_format": "base64"}),
    "embeddings, dimensions": ("/v1/embeddings", {"input": "hello", "dimensions": 8}),
    "embeddings, truncated": ("/v1/embeddings", {"input": "one two three four five", "truncate_prompt_tokens": 2}),
    "embeddings, chat messages": ("/v1/embeddings", {"messages": [{"role": "user", "content": "hi there"}]}),
    "embeddings, too long": ("/v1/embeddings", {"input": "word " * 600}),
    "cohere embed": ("/v2/embed", {"texts": ["hello", "world"], "embedding_types": ["float"]}),
    "pooling": ("/pooling", {"input": "hello"}),
    "score": ("/score", {"queries": "what is it", "documents": ["it is a thing", "nothing"]}),
    "v1 score": ("/v1/score", {"text_1": "a", "text_2": ["b", "c"]}),
    "classify": ("/classify", {"input": "hello"}),
    "rerank": ("/rerank", {"query": "q", "documents": ["a", "b"]}),
    "v2 rerank": ("/v2/rerank", {"query": "q", "documents": ["a"]}),
}


@pytest.fixture(scope="module")
def served() -> Iterator[str]:
    env = vllm_env()
    args = ["--convert", "embed"]
    with running_vllm_openai_server(env, served_model_name=MODEL, args=args, ready_timeout=600.0) as (_, base_url):
        yield base_url


@pytest.fixture(scope="module")
def gateway(package_database_url: str, served: str) -> Iterator[RunningGateway]:
    replicas = [ReplicaConfig(id="vllm-embed", url=served, kind="openai")]
    with running_gateway(package_database_url, replicas, models={MODEL: "compat"}, health_interval_s=30) as running:
        yield running


@pytest.mark.parametrize("case", list(CASES))
def test_a_pooling_request_gets_the_answer_vllm_serve_gives(served: str, gateway: RunningGateway, case: str) -> None:
    path, body = CASES[case]
    asked = {"model": MODEL, **body}
    with httpx.Client(timeout=120) as http:
        direct, through = ask(http, served, path, asked), ask(http, gateway.url, path, asked)
    assert differences(direct, through) == []
    # what vLLM itself refuses: classify (the converted model has no classification head),
    # dimensions (it is not a Matryoshka model) and a prompt over its 512 tokens
    refused = case in ("classify", "embeddings, dimensions", "embeddings, too long")
    assert (direct.status >= 400) == refused, (direct.status, direct.body)


@pytest.mark.parametrize("encoding", ["bytes", "bytes_only"])
def test_an_embeddings_bytes_answer_is_vllms_bytes(served: str, gateway: RunningGateway, encoding: str) -> None:
    asked = {"model": MODEL, "input": ["hello", "world"], "encoding_format": encoding}
    with httpx.Client(timeout=120) as http:
        direct, through = (
            http.post(served + "/v1/embeddings", json=asked),
            http.post(gateway.url + "/v1/embeddings", json=asked),
        )
    assert (through.status_code, through.content) == (direct.status_code, direct.content)
    assert through.headers["content-type"] == direct.headers["content-type"]
    assert ("metadata" in through.headers) == ("metadata" in direct.headers) == (encoding == "bytes")


def test_the_openai_sdk_and_langchain_get_the_same_vectors(served: str, gateway: RunningGateway) -> None:
    from langchain_openai import OpenAIEmbeddings

    texts = ["the first text", "a second"]
    got = []
    for base_url in (served, gateway.url):
        with openai.OpenAI(base_url=base_url + "/v1", api_key="unused") as client:
            sdk = [item.embedding for item in client.embeddings.create(model=MODEL, input=texts).data]
        chain = OpenAIEmbeddings(
            model=MODEL,
            base_url=base_url + "/v1",
            api_key="unused",
            check_embedding_ctx_length=False,  # type: ignore[arg-type]
        )
        got.append((sdk, chain.embed_documents(texts)))
    assert got[0] == got[1]
    assert got[0][0] == got[0][1] and len(got[0][0][0]) > 0
