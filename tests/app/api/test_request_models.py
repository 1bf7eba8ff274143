"""One declaration per request (app/contract/requests.py, app/contract/responses.py): what
``/openapi.json`` describes is what the gateway checks, field by field.

For every field the description gives a schema, each value it refuses is refused by the
gateway with a 400 naming that field, and a value it describes is never refused for its
JSON type (a rule no schema says may refuse it: a ``guided_json`` string that holds no
schema); phasegate's own fields are described as never allowed, and refused.
"""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest

from app.api.chat.request import parse_request
from app.api.errors import InvalidRequest
from app.api.openapi import openapi_document
from app.api.responses.request import parse_responses_request
from app.config import GatewayConfig, Limits
from app.contract.request_fields import OWN, WHOLE_ONLY
from app.contract.requests import PASSED_CHAT, PASSED_COMPLETIONS
from app.contract.responses import NOT_SERVED
from app.driver.request import CHAT, COMPLETIONS

RESPONSES = "responses"

LIMITS = Limits(max_tokens=1000, max_n=8)
DOCUMENT = openapi_document(GatewayConfig(models={"m": "r1"}, limits=LIMITS))
SCHEMAS = DOCUMENT["components"]["schemas"]
BASES = {
    CHAT: ("CreateChatCompletionRequest", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
    COMPLETIONS: ("CreateCompletionRequest", {"model": "m", "prompt": "hi"}),
    RESPONSES: ("CreateResponseRequest", {"model": "m", "input": "hi"}),
}
# values of every JSON type, one of which each field's schema refuses
CANDIDATES: tuple[Any, ...] = ({"an": "object"}, "a string", 12345, 0.5, True, [1], [], -5, "")


JSON_TYPES = ("a boolean", "an integer", "a number", "a string", "an array", "an object")


def _validator(schema: dict[str, Any] | bool) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator({"allOf": [schema], "components": DOCUMENT["components"]})


def parse(endpoint: str, body: dict[str, Any]) -> None:
    if endpoint == RESPONSES:
        parse_responses_request(body, LIMITS)
    else:
        parse_request(endpoint, body, LIMITS)


def _fields(endpoint: str) -> list[tuple[str, str]]:
    name, _ = BASES[endpoint]
    return [(endpoint, field) for field in sorted(SCHEMAS[name]["properties"]) if field != "model"]


@pytest.mark.parametrize(("endpoint", "field"), [*_fields(CHAT), *_fields(COMPLETIONS), *_fields(RESPONSES)])
def test_a_value_the_description_refuses_the_gateway_refuses_naming_the_field(endpoint: str, field: str) -> None:
    name, base = BASES[endpoint]
    described = _validator(SCHEMAS[name]["properties"][field])
    refused = [value for value in CANDIDATES if not described.is_valid(value)]
    if not refused:
        assert set(SCHEMAS[name]["properties"][field]) <= {"default", "title"}, field
        return  # any value (a field passed on unread)
    for value in refused:
        with pytest.raises(InvalidRequest) as caught:
            parse(endpoint, {**base, field: value})
        assert caught.value.param is not None and caught.value.param.startswith(field), (field, value)
        assert caught.value.status == 400
        refused_by_name = field in OWN or field in WHOLE_ONLY or (endpoint == RESPONSES and field in NOT_SERVED)
        if refused_by_name:
            assert caught.value.code == "unsupported_parameter", (field, value)
        elif endpoint != RESPONSES:  # a Responses value phasegate does not serve is unsupported_parameter too
            assert caught.value.code == "invalid_request", (field, value)
    for value in CANDIDATES:
        if described.is_valid(value) and value is not None:
            try:
                parse(endpoint, {**base, field: value})
            except InvalidRequest as refusal:  # a rule no schema says may refuse it, never its type
                assert not refusal.message.endswith(JSON_TYPES), (field, value, refusal.message)


def test_the_description_declares_every_field_vllm_declares_and_refuses_phasegates_own() -> None:
    for endpoint, passed in ((CHAT, PASSED_CHAT), (COMPLETIONS, PASSED_COMPLETIONS)):
        name, base = BASES[endpoint]
        properties = SCHEMAS[name]["properties"]
        assert passed <= set(properties) and all(properties[own] is False for own in OWN)
        assert _validator(SCHEMAS[name]).is_valid(base)
        assert not _validator(SCHEMAS[name]).is_valid({**base, "request_id": "mine"})
    assert SCHEMAS["CreateChatCompletionRequest"]["properties"]["max_tokens"]["anyOf"][0]["maximum"] == 1000
    assert SCHEMAS["CreateChatCompletionRequest"]["properties"]["n"]["anyOf"][0]["maximum"] == 8
    responses = SCHEMAS["CreateResponseRequest"]
    assert responses["additionalProperties"] is False and all(responses["properties"][name] for name in NOT_SERVED)
    assert not _validator(responses).is_valid({**BASES[RESPONSES][1], "colour": "blue"})
    assert responses["properties"]["temperature"] == SCHEMAS["CreateChatCompletionRequest"]["properties"]["temperature"]
    message = SCHEMAS["Message"]
    assert message["properties"]["role"]["enum"] == ["assistant", "developer", "system", "tool", "user"]
