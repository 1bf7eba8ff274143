"""Pooling requests against ``vllm serve`` serving a pooling model (docs/design.md §17): the
tiny model with vLLM's embedding conversion (``--convert embed``), one more ``vllm serve``
process of this module, and beside it ``phasegate worker --engine vllm`` of the same model
with the same flags (its pooling requests answered by vLLM's own pooling servers:
app/worker/vllm_pooling.py). A gateway stands in front of each, the server as an ``openai``
replica, the worker as a ``worker`` replica. The same request goes to ``vllm serve`` and
through each gateway, and what a client gets is compared (tests/compat/compare.py: ids and
creation times set aside); the real clients (the ``openai`` SDK's ``embeddings.create``,
langchain's ``OpenAIEmbeddings``) against both.

The converted model serves embeddings, pooling, score and rerank (the cosine of the two
sides' embeddings); classify needs a classification head the tiny model does not have, so
its answer is tested against the sim engine's (tests/app/api/test_pooling.py) and here only
for refusing as vLLM refuses it, as is a chat completion, which a pooling model does not
serve. Both run eagerly (``enforce_eager``): the same kernels, so the same floats, and a
start in half the time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from app.config import ReplicaConfig
from statemachine import events as ev
from statemachine.replay import replay
from statemachine.request_state import Outcome
from statemachine.state import fold
from tests.compat.compare import ask, differences
from tests.compat.conftest import PATIENT
from tests.support.gateway import RunningGateway, running_gateway
from tests.support.transcript import of
from tests.support.vllm_replicas import stop_starts
from tests.support.workers import running_vllm_openai_server, start_worker, vllm_env

# its own vllm serve and vLLM worker (an embedding model): a unit of its own, beside the shared vLLM group
pytestmark = [pytest.mark.vllm, pytest.mark.vllm_subprocess]

MODEL = "tiny-embed"
SERVER_ARGS = ["--convert", "embed", "--enforce-eager"]
WORKER_ARGS = ["--model", MODEL, "--convert", "embed", "--vllm-args", '{"enforce_eager": true}']
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
    "chat completion": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
}
# what vLLM itself refuses: classify (the converted model has no classification head),
# dimensions (it is not a Matryoshka model), a prompt over its 512 tokens, and generation
REFUSED = {"classify", "embeddings, dimensions", "embeddings, too long", "chat completion"}
KINDS = ("openai replica", "worker replica")
# where a client of a worker replica gets another answer than vLLM's, and why (strict
# xfail; docs/compatibility.md, "Pooling requests"): none
WORKER_DIVERGENCES: dict[str, str] = {}


@dataclass
class Served:
    """``vllm serve`` and a gateway in front of each replica kind."""

    direct: str
    gateways: dict[str, RunningGateway]  # by replica kind


@pytest.fixture(scope="module")
def served(package_database_url: str) -> Iterator[Served]:
    """The server and the worker started together (a vLLM start is minutes of both cores
    here: one after the other would double it), then a gateway in front of each."""
    env = vllm_env()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="pooling-worker-start") as starts:
        starting = starts.submit(
            start_worker, engine="vllm", python=env.python, model_path=env.model, args=WORKER_ARGS, ready_timeout=900.0
        )
        try:
            with running_vllm_openai_server(env, served_model_name=MODEL, args=SERVER_ARGS, ready_timeout=900.0) as (
                _,
                url,
            ):
                worker = starting.result()
                replicas = {
                    "openai replica": ReplicaConfig(id="vllm-embed", url=url, kind="openai"),
                    "worker replica": ReplicaConfig(id="vllm-embed-worker", url=worker.base_url, kind="worker"),
                }
                with contextlib.ExitStack() as stack:
                    gateways = {
                        kind: stack.enter_context(
                            running_gateway(
                                package_database_url,
                                [replica],
                                models={MODEL: "compat"},
                                health_interval_s=30,
                                timeouts=PATIENT,
                            )
                        )
                        for kind, replica in replicas.items()
                    }
                    yield Served(url, gateways)
        finally:
            stop_starts([starting])  # the worker, killed with its engine processes


def _cases() -> list[Any]:
    cases = []
    for case in CASES:
        for kind in KINDS:
            why = WORKER_DIVERGENCES.get(case) if kind == "worker replica" else None
            marks = [pytest.mark.xfail(strict=True, reason=why)] if why else []
            cases.append(pytest.param(case, kind, id=f"{case} [{kind}]", marks=marks))
    return cases


@pytest.mark.parametrize(("case", "kind"), _cases())
def test_a_pooling_request_gets_the_answer_vllm_serve_gives(served: Served, case: str, kind: str) -> None:
    path, body = CASES[case]
    asked = {"model": MODEL, **body}
    with httpx.Client(timeout=120) as http:
        direct, through = ask(http, served.direct, path, asked), ask(http, served.gateways[kind].url, path, asked)
    found = differences(direct, through)
    assert found == [], "\n".join(found)
    assert (direct.status >= 400) == (case in REFUSED), (direct.status, direct.body)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("encoding", ["bytes", "bytes_only"])
def test_an_embeddings_bytes_answer_is_vllms_bytes(served: Served, encoding: str, kind: str) -> None:
    asked = {"model": MODEL, "input": ["hello", "world"], "encoding_format": encoding}
    with httpx.Client(timeout=120) as http:
        direct = http.post(served.direct + "/v1/embeddings", json=asked)
        through = http.post(served.gateways[kind].url + "/v1/embeddings", json=asked)
    assert direct.status_code == 200 and direct.content
    assert (through.status_code, through.content) == (direct.status_code, direct.content)
    assert through.headers["content-type"] == direct.headers["content-type"]
    assert ("metadata" in through.headers) == ("metadata" in direct.headers) == (encoding == "bytes")


@pytest.mark.parametrize("kind", KINDS)
def test_the_openai_sdk_and_langchain_get_the_same_vectors(served: Served, kind: str) -> None:
    from langchain_openai import OpenAIEmbeddings

    texts = ["the first text", "a second"]
    got = []
    for base_url in (served.direct, served.gateways[kind].url):
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


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("path", ["/v1/embeddings", "/score"])
def test_the_log_counts_the_prompt_tokens_vllm_states(served: Served, path: str, kind: str) -> None:
    """The client and the log agree: the prompt tokens of a pooling request's answer are
    the ones its log completes with, whichever replica kind answered (docs/design.md §17)."""
    body = CASES["embeddings, a batch" if path == "/v1/embeddings" else "score"][1]
    gateway = served.gateways[kind]
    with httpx.Client(timeout=120) as http:
        response = http.post(gateway.url + path, json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    request_id = response.headers["x-request-id"]
    gateway.wait_logged(request_id, lambda events: fold(events).outcome is not None)
    events = gateway.logged(request_id)
    assert replay(events).ok and fold(events).outcome is Outcome.COMPLETED
    (completed,) = of(events, ev.RequestCompleted)
    stated = response.json()["usage"]["prompt_tokens"]
    assert completed.usage["prompt_tokens"] == stated > 0  # type: ignore[attr-defined]
