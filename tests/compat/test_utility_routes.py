"""vLLM's utility routes through phasegate (app/api/utility/routes.py): ``/tokenize``,
``/detokenize``, ``/version`` and ``/health`` answer as ``vllm serve`` answers them, in front
of it and in front of the vLLM worker (tests/compat/conftest.py ``target``).
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.compat.compare import Answer, ask, differences
from tests.compat.conftest import Pair
from tests.compat.test_differential import CONVERSATION, TOOLS
from tests.support.vllm_replicas import MODEL

pytestmark = pytest.mark.vllm

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "a prompt": ("/tokenize", {"model": MODEL, "prompt": "hello there, tell me a story"}),
    "a prompt, no special tokens, token strings": (
        "/tokenize",
        {"model": MODEL, "prompt": "hello there", "add_special_tokens": False, "return_token_strs": True},
    ),
    "no model named": ("/tokenize", {"prompt": "hello"}),
    "messages": ("/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
    "messages without the generation prompt": (
        "/tokenize",
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False},
    ),
    "messages and tools": ("/tokenize", {"model": MODEL, "messages": CONVERSATION[-1:], "tools": TOOLS}),
    "detokenize": ("/detokenize", {"model": MODEL, "tokens": [20, 21, 22, 23]}),
    # refusals: the same status (the message and param are each server's own)
    "tokenize without a prompt": ("/tokenize", {"model": MODEL}),
    "detokenize a negative id": ("/detokenize", {"model": MODEL, "tokens": [-1]}),
}


@pytest.mark.parametrize("case", CASES)
def test_a_utility_route_answers_as_vllm_serve(target: Pair, case: str) -> None:
    path, body = CASES[case]
    direct, through = target.both(path, body)
    if direct.status >= 400:
        assert (through.status, through.body["error"]["type"]) == (direct.status, direct.body["error"]["type"])
        return
    assert direct.status == 200, direct.body
    found = differences(direct, through)
    assert found == [], "\n".join(found)


def test_version_and_health_answer_as_vllm_serve(target: Pair) -> None:
    with httpx.Client(timeout=60) as http:
        direct, through = (http.get(url + "/version") for url in (target.direct_url, target.gateway_url))
        assert direct.status_code == through.status_code == 200 and direct.json() == through.json()
        assert direct.json()["version"]
        direct, through = (http.get(url + "/health") for url in (target.direct_url, target.gateway_url))
        assert direct.status_code == through.status_code == 200 and direct.content == through.content == b""


def test_an_unknown_model_is_refused_by_phasegate_as_by_vllm(target: Pair) -> None:
    """404, before any replica is asked."""
    body = {"model": "no-such-model", "prompt": "hello"}
    with httpx.Client(timeout=60) as http:
        direct: Answer = ask(http, target.direct_url, "/tokenize", body)
        through: Answer = ask(http, target.gateway_url, "/tokenize", body)
    assert direct.status == through.status == 404
    assert through.body["error"]["code"] == "model_not_found" and through.body["error"]["param"] == "model"
