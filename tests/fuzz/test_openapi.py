"""schemathesis against the running gateway, from the ``/openapi.json`` it serves.

Each operation of the description (chat completions, completions, models, the Responses
API's create, read, list, cancel and delete, the Messages API's create and count_tokens, the
pooling routes) gets cases that
fit it (positive) and cases that break it (negative), sent to the live ``phasegate serve``
with a tenant's key. schemathesis judges each answer: no 5xx, a status and a content type
the description lists, a body that fits its schema, and every negative case refused. The
suite's own properties hold too: no event under a refused request's id, and the log apart
from accepted requests unchanged.

Positive cases are not required to be accepted: what JSON Schema cannot say (a named
``tool_choice`` must name one of the tools, ``stream_options`` only with ``stream``) is a 400
naming the ``param``, as app/api/openapi.py says.
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import given
from schemathesis import APIOperation, CheckFunction, GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from tests.fuzz.conftest import API_KEY, MAX_TOKENS, MODEL, SCHEMA_EXAMPLES, Stack, Tally, fuzz_settings

# untraced: the gateway and worker are processes of their own, measured there (tests/conftest.py)
pytestmark = [pytest.mark.slow, pytest.mark.untraced]

KEY = {"authorization": f"Bearer {API_KEY}"}
FAMILIES = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/models": "models",
    "/v1/responses": "responses",
    "/v1/responses/{response_id}": "responses.stored",
    "/v1/responses/{response_id}/input_items": "responses.input_items",
    "/v1/responses/{response_id}/cancel": "responses.cancel",
    "/v1/messages": "messages",
    "/v1/messages/count_tokens": "messages.count_tokens",
    "/v1/embeddings": "pooling.embeddings",
    "/v2/embed": "pooling.embed",
    "/pooling": "pooling.pooling",
    "/classify": "pooling.classify",
    "/score": "pooling.score",
    "/v1/score": "pooling.v1_score",
    "/rerank": "pooling.rerank",
    "/v1/rerank": "pooling.v1_rerank",
    "/v2/rerank": "pooling.v2_rerank",
}
CHECKS: list[CheckFunction] = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


def test_the_description_names_what_the_gateway_serves(stack: Stack) -> None:
    with stack.gateway_client() as http:
        assert http.get("/openapi.json").status_code == 401  # it lists the models: behind the key
        document = http.get("/openapi.json", headers=KEY).json()
    request = document["components"]["schemas"]["CreateChatCompletionRequest"]
    # the one model served, or none named (a body without model asks for it, as vllm serve's does)
    assert request["properties"]["model"]["enum"] == [MODEL, None] and "model" not in request["required"]
    assert request["properties"]["max_tokens"]["anyOf"][0]["maximum"] == MAX_TOKENS
    assert sorted(document["paths"]) == sorted(FAMILIES)
    responses = document["components"]["schemas"]["CreateResponseRequest"]
    assert responses["properties"]["model"]["enum"] == [MODEL, None]
    assert responses["properties"]["conversation"]["type"] == "null"  # not served: refused unless null
    messages = document["components"]["schemas"]["CreateMessageRequest"]
    assert messages["properties"]["model"]["enum"] == [MODEL, None] and "max_tokens" in messages["required"]
    assert messages["properties"]["max_tokens"]["maximum"] == MAX_TOKENS
    assert messages["properties"]["container"]["type"] == "null"
    embeddings = document["components"]["schemas"]["CreateEmbeddingRequest"]
    assert embeddings["properties"]["model"]["enum"] == [MODEL, None]
    assert embeddings["properties"]["encoding_format"]["enum"] == ["float", "base64", "bytes", "bytes_only"]
    # each route whose body takes encoding_format answers bytes in application/octet-stream for it
    octets = {path for path, item in document["paths"].items() if "application/octet-stream" in _ok(item)}
    assert octets == {"/v1/embeddings", "/pooling"}


def _ok(item: dict) -> dict:
    return next(iter(item.values()))["responses"].get("200", {}).get("content", {})


@pytest.mark.own_unit  # minutes of schemathesis each: the two modes run side by side
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["positive", "negative"])
def test_schemathesis(stack: Stack, tally: Tally, mode: GenerationMode) -> None:
    with stack.gateway_client() as http:
        document = http.get("/openapi.json", headers=KEY).json()
    schema = schemathesis.openapi.from_dict(document)
    before = stack.log_apart_from(set(tally.accepted))
    checks = [*CHECKS, negative_data_rejection] if mode is GenerationMode.NEGATIVE else CHECKS
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) == 19
    for operation in operations:
        run_operation(stack, tally, operation, mode, checks)
    assert stack.log_apart_from(tally.accepted) == before, "refused requests changed the log"
    assert stack.server_faults() == []


def run_operation(
    stack: Stack, tally: Tally, operation: APIOperation, mode: GenerationMode, checks: list[CheckFunction]
) -> None:
    family = f"schemathesis.{mode.value}.{FAMILIES[operation.path]}.{operation.method.lower()}"
    counting = operation.path == "/v1/messages/count_tokens"
    if counting:  # it asks the replica's tokenizer: the sim has none and says so (501, described), as on /tokenize
        checks = [check for check in checks if check is not not_a_server_error]

    @fuzz_settings(SCHEMA_EXAMPLES)
    @given(case=operation.as_strategy(generation_mode=mode))
    def property_(case: schemathesis.Case) -> None:
        response = case.call(base_url=stack.gateway.url, headers=KEY, timeout=30)
        tally.record(family, response.status_code)
        request_id = (response.headers.get("x-request-id") or [None])[0]
        if request_id is not None and response.status_code < 300 and operation.method.upper() == "POST":
            tally.accepted.add(request_id)
        elif request_id is not None and response.status_code >= 400 and request_id not in tally.accepted:
            error = response.json()["error"]  # (the Messages API's: Anthropic's shape, the same fields)
            if "partial_output" in error:  # accepted, then refused by its replica: the log says so
                tally.accepted.add(request_id)
                assert stack.failed_with(request_id, error["code"]) == 1, f"{request_id}: the log disagrees"
            else:  # refused by the gateway: never logged
                assert stack.events_of(request_id) == 0, f"refused {request_id} is in the log"
        if counting and response.status_code >= 500:
            assert response.status_code == 501 and "no tokenizer" in response.text, response.text
        case.validate_response(response, checks=checks)

    property_()


def test_the_description_is_served_as_json(stack: Stack) -> None:
    response = httpx.get(stack.gateway.url + "/openapi.json", headers=KEY, timeout=10)
    assert response.headers["content-type"] == "application/json"
    assert response.json()["openapi"] == "3.1.0"
