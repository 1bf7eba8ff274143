"""What phasegate does not serve is refused by name (app/api/utility/unserved.py, docs/design.md
§17): a 404 in the OpenAI error shape with the stable code ``not_served`` and the reason,
for every method, before any replica is asked and with nothing logged; and
docs/compatibility.md lists each route with the same reason."""

from __future__ import annotations

import re
from pathlib import Path

import openai
import pytest

from app.api.utility.unserved import NOT_SERVED
from tests.app.api.test_serving import attempts_on
from tests.support.gateway import RunningGateway
from tests.support.workers import WorkerProcess

PAGE = (Path(__file__).parents[3] / "docs" / "compatibility.md").read_text()
EXAMPLES = {
    "/v1/audio/transcriptions": "POST",
    "/v1/realtime": "GET",
    "/v1/realtime/sessions": "POST",
    "/v1/files": "POST",
    "/v1/files/file-abc/content": "GET",
    "/v1/batches/batch_1/cancel": "POST",
    "/v1/chat/completions/batch": "POST",
    "/invocations": "POST",
    "/ping": "GET",
    "/v1/load_lora_adapter": "POST",
    "/sleep": "POST",
}


@pytest.mark.parametrize(("path", "method"), EXAMPLES.items())
def test_a_route_phasegate_does_not_serve_is_a_404_saying_so(
    gateway: RunningGateway, sim_pair: list[WorkerProcess], path: str, method: str
) -> None:
    before = attempts_on(sim_pair)
    with gateway.http() as http:
        response = http.request(method, path, json={"model": "sim", "input": "x"})
    assert attempts_on(sim_pair) == before
    assert response.status_code == 404
    error = response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "not_served", None)
    served = next(
        route for route in NOT_SERVED if path == route.rstrip("/") or (path.startswith(route) and route.endswith("/"))
    )
    assert error["message"].startswith(f"phasegate does not serve {served.rstrip('/')}: ")
    assert NOT_SERVED[served] in error["message"]
    assert response.headers["x-should-retry"] == "false"
    assert error["request_id"] == response.headers["x-request-id"]
    assert gateway.events(response.headers["x-request-id"]) == []


def test_the_openai_client_gets_a_not_found_error_naming_the_route(gateway: RunningGateway) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        gateway.openai().audio.transcriptions.create(model="sim", file=("a.wav", b"RIFF"))
    assert caught.value.code == "not_served" and "/v1/audio/transcriptions" in caught.value.message
    with gateway.http() as http:  # a route of nothing at all stays the plain 404
        assert http.get("/v1/nothing").json()["error"]["code"] == "not_found"


def test_the_compatibility_page_lists_each_route_not_served() -> None:
    listed = set(re.findall(r"`((?:GET |POST |)/[a-z0-9_/{}.]+)`", PAGE))
    paths = {item.split(" ")[-1] for item in listed}
    assert sorted(route.rstrip("/") for route in NOT_SERVED if route.rstrip("/") not in paths) == []
