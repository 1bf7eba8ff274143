"""vLLM's utility routes through a gateway over real sim workers (app/api/utility/routes.py): the
refusals that never reach a replica, and the sim engine's own (it has no tokenizer). What
they answer from vLLM is tests/compat/test_utility_routes.py.
"""

from __future__ import annotations

import time

from tests.support.gateway import MODEL, RunningGateway, running_gateway
from tests.support.workers import WorkerProcess

KEY = "sk-utility-routes"


def test_tokenize_needs_the_key_a_known_model_and_a_json_object(
    database_url: str, sim_pair: list[WorkerProcess]
) -> None:
    with running_gateway(database_url, sim_pair, api_keys={KEY: "team"}) as gateway, gateway.http() as http:
        unauthorized = http.post("/tokenize", json={"model": MODEL, "prompt": "hi"})
        assert unauthorized.status_code == 401 and unauthorized.json()["error"]["code"] == "invalid_api_key"
        auth = {"authorization": f"Bearer {KEY}"}
        unknown = http.post("/tokenize", json={"model": "nope", "prompt": "hi"}, headers=auth)
        assert unknown.status_code == 404
        assert (unknown.json()["error"]["code"], unknown.json()["error"]["param"]) == ("model_not_found", "model")
        for raw, code in ((b"[1, 2]", "invalid_json"), (b"{nope", "invalid_json")):
            refused = http.post("/detokenize", content=raw, headers={**auth, "content-type": "application/json"})
            assert refused.status_code == 400 and refused.json()["error"]["code"] == code
        texts = http.post("/tokenize", content=b"{}", headers={**auth, "content-type": "text/plain"})
        assert texts.status_code == 415
        assert unauthorized.headers["x-request-id"] != unknown.headers["x-request-id"]


def test_the_sim_engine_has_no_tokenizer_and_says_so_in_vllms_error_shape(gateway: RunningGateway) -> None:
    with gateway.http() as http:
        for method, path, body in (
            ("POST", "/tokenize", {"model": MODEL, "prompt": "hi"}),
            ("POST", "/detokenize", {"model": MODEL, "tokens": [1]}),
            ("GET", "/version", None),
        ):
            answer = http.request(method, path, json=body)
            assert answer.status_code == 501, answer.text
            error = answer.json()["error"]
            assert (error["type"], error["code"]) == ("Not Implemented", 501)
            assert "the sim engine has no tokenizer" in error["message"] and path in error["message"]


def test_health_is_vllms_empty_200_while_ready_and_503_without_a_replica(
    database_url: str, sim_pair: list[WorkerProcess]
) -> None:
    with running_gateway(database_url, sim_pair) as gateway, gateway.http() as http:
        healthy = http.get("/health")
        assert (healthy.status_code, healthy.content) == (200, b"")
    with running_gateway(database_url, [NoWorker()]) as gateway, gateway.http() as http:
        # out once its probes failed in a row (eject_after_failures), as /readyz says
        deadline = time.monotonic() + 30
        while http.get("/health").status_code != 503 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert http.get("/health").status_code == 503 and http.get("/readyz").status_code == 503
        refused = http.post("/tokenize", json={"model": MODEL, "prompt": "hi"})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "no_replica_available"


class NoWorker:
    """A replica address where nothing listens (a closed port)."""

    base_url = "http://127.0.0.1:9"
