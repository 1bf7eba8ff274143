"""HTTP hardening (docs/design.md §13): JSON only on POST, CORS off unless configured, /metrics and
/v1/models behind their tokens, and ``x-should-retry: false`` where a retry cannot help.
A real gateway over real sim workers, real HTTP."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest

from app.config import ConfigError, load_config
from app.store import migrate
from tests.app.conftest import add_fault
from tests.support.gateway import MODEL, RunningGateway, running_gateway
from tests.support.workers import WorkerProcess

BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
METRICS_TOKEN = "metrics-" + uuid.uuid4().hex


def _attempts_on(workers: list[WorkerProcess]) -> int:
    return sum(len(httpx.get(w.base_url + "/admin/attempts", timeout=5).json()["attempts"]) for w in workers)


@pytest.mark.parametrize(
    "content_type",
    [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "application/jsonx"],
)
def test_a_post_not_declared_as_json_is_415(
    gateway: RunningGateway, sim_pair: list[WorkerProcess], content_type: str | None
) -> None:
    before = _attempts_on(sim_pair)
    headers = {} if content_type is None else {"content-type": content_type}
    with gateway.http() as http:
        response = http.post("/v1/chat/completions", content=json.dumps(BODY).encode(), headers=headers)
    assert response.status_code == 415, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"], error["type"]) == (
        "unsupported_media_type",
        "content-type",
        "invalid_request_error",
    )
    assert response.headers["x-should-retry"] == "false"
    assert _attempts_on(sim_pair) == before


def test_json_with_a_charset_is_json(gateway: RunningGateway) -> None:
    with gateway.http() as http:
        response = http.post(
            "/v1/chat/completions",
            content=json.dumps(BODY).encode(),
            headers={"content-type": "Application/JSON; charset=utf-8"},
        )
    assert response.status_code == 200, response.text
    assert "x-should-retry" not in response.headers


def test_cors_is_off_by_default(gateway: RunningGateway) -> None:
    origin = {"origin": "https://evil.example"}
    with gateway.http() as http:
        preflight = http.options(
            "/v1/chat/completions",
            headers={
                **origin,
                "access-control-request-method": "POST",
                "access-control-request-headers": "content-type",
            },
        )
        answer = http.post("/v1/chat/completions", json=BODY, headers=origin)
    assert "access-control-allow-origin" not in preflight.headers and preflight.status_code >= 400
    assert answer.status_code == 200 and "access-control-allow-origin" not in answer.headers


def test_cors_answers_only_the_configured_origins(database_url: str, sim_pair: list[WorkerProcess]) -> None:
    allowed = "https://app.example"
    with running_gateway(database_url, sim_pair, cors_allow_origins=(allowed,)) as gateway, gateway.http() as http:
        asks = {"access-control-request-method": "POST", "access-control-request-headers": "authorization,content-type"}
        ok = http.options("/v1/chat/completions", headers={"origin": allowed, **asks})
        other = http.options("/v1/chat/completions", headers={"origin": "https://evil.example", **asks})
        answer = http.post("/v1/chat/completions", json=BODY, headers={"origin": allowed})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == allowed
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    assert answer.headers["access-control-allow-origin"] == allowed
    assert "x-request-id" in answer.headers["access-control-expose-headers"]


def test_metrics_and_models_behind_their_tokens(database_url: str, sim_pair: list[WorkerProcess]) -> None:
    with (
        running_gateway(database_url, sim_pair, metrics_token=METRICS_TOKEN, api_keys={"key-a": "tenant-a"}) as gateway,
        gateway.http() as http,
    ):
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "Bearer key-a"}):
            refused = http.get("/metrics", headers=headers)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_metrics_token"
            assert refused.headers["x-should-retry"] == "false"
        assert "phasegate" in http.get("/metrics", headers={"authorization": f"Bearer {METRICS_TOKEN}"}).text
        assert http.get("/v1/models").status_code == 401
        listed = http.get("/v1/models", headers={"authorization": "Bearer key-a"})
        assert [m["id"] for m in listed.json()["data"]] == [MODEL]
        assert http.get("/healthz").status_code == 200  # probes stay open


def test_the_metrics_and_cors_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="cors_allow_origins"):
        load_config(None, cors_allow_origins=("https://app.example/path",))
    with pytest.raises(ConfigError, match="cors_allow_origins"):
        load_config(None, cors_allow_origins="https://app.example")
    with pytest.raises(ConfigError, match="metrics_token"):
        load_config(None, metrics_token="short")
    assert METRICS_TOKEN not in repr(load_config(None, metrics_token=METRICS_TOKEN))


def test_x_should_retry_false_only_where_a_retry_cannot_help(
    empty_database_url: str, sim_pair: list[WorkerProcess], gateway: RunningGateway
) -> None:
    with gateway.http() as http:
        assert http.post("/v1/chat/completions", json={**BODY, "temperature": -1}).headers["x-should-retry"] == "false"
        assert http.post("/v1/chat/completions", json={**BODY, "model": "nope"}).headers["x-should-retry"] == "false"
        assert http.get("/v1/nothing").headers["x-should-retry"] == "false"
    # a database of its own: every gateway on one database shares its fleet (docs/design.md §16)
    migrate.upgrade(empty_database_url)
    with running_gateway(empty_database_url, []) as empty, empty.http() as http:
        unavailable = http.post("/v1/chat/completions", json=BODY)
    assert unavailable.status_code == 503 and "x-should-retry" not in unavailable.headers  # later it may work


def test_a_replicas_4xx_for_a_request_is_the_clients_and_never_ejects(
    gateway: RunningGateway, sim_pair: list[WorkerProcess]
) -> None:
    """The worker refuses one request with a 4xx, more times than eject_after_failures: the
    client gets that 4xx with x-should-retry: false, and both replicas stay in."""
    prompt = "refuse me " + uuid.uuid4().hex
    for worker in sim_pair:
        add_fault(
            worker, action="reject", status=422, code="invalid_field", match={"prompt_contains": prompt}, times=None
        )
    body = {**BODY, "messages": [{"role": "user", "content": prompt}]}
    with gateway.http() as http:
        for _ in range(4):
            response = http.post("/v1/chat/completions", json=body)
            assert response.status_code == 422, response.text
            assert response.json()["error"]["code"] == "invalid_field"
            assert response.headers["x-should-retry"] == "false"
        assert http.post("/v1/chat/completions", json=BODY).status_code == 200
    pool = gateway.gateway.ctx.pool
    assert all(pool.available(r) and r.consecutive_failures == 0 for r in pool.replicas.values())
