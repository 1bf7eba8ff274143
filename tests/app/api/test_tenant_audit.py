"""A tenant's key reads its own requests' audit; the admin token reads all; another
tenant's request is 404, as an unknown one is (docs/design.md §13). Real gateway, real sim
workers, real PostgreSQL, the real ``openai`` client."""

from __future__ import annotations

import base64

import httpx

from tests.support.audit import execute_sql
from tests.support.gateway import MODEL, RunningGateway, running_gateway
from tests.support.workers import WorkerProcess

KEYS = {"key-a": "team-a", "key-b": "team-b"}
ADMIN_TOKEN = "admin-token-for-audit"
MESSAGES = [{"role": "user", "content": "Hello"}]


def served(gateway: RunningGateway, key: str) -> str:
    raw = gateway.openai(api_key=key).chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=3
    )
    request_id = raw.headers["x-request-id"]
    gateway.events(request_id)  # settled
    return request_id


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def reads(http: httpx.Client, request_id: str, headers: dict[str, str]) -> list[int]:
    paths = (f"/v1/requests/{request_id}", f"/v1/requests/{request_id}/events", f"/ui/requests/{request_id}")
    return [http.get(path, headers=headers).status_code for path in paths]


def test_a_tenant_reads_its_own_requests_and_no_one_elses(database_url: str, sim_pair: list[WorkerProcess]) -> None:
    with running_gateway(database_url, sim_pair, api_keys=KEYS, admin_token=ADMIN_TOKEN) as gateway:
        mine, theirs = served(gateway, "key-a"), served(gateway, "key-b")
        with gateway.http() as http:
            summary = http.get(f"/v1/requests/{mine}", headers=bearer("key-a"))
            assert summary.status_code == 200 and summary.json()["request"]["tenant"] == "team-a"
            events = http.get(f"/v1/requests/{mine}/events", headers=bearer("key-a")).json()["data"]
            assert events[0]["type"] == "RequestAccepted" and events[-1]["type"] == "RequestCompleted"
            basic = {"authorization": "Basic " + base64.b64encode(b"anyone:key-a").decode()}
            assert reads(http, mine, basic) == [200, 200, 200]  # a browser, with the key as the password

            # another tenant's request is answered exactly as one that does not exist
            for path in ("/v1/requests/{}", "/v1/requests/{}/events"):
                hidden = http.get(path.format(theirs), headers=bearer("key-a"))
                unknown = http.get(path.format("req_no_such_request"), headers=bearer("key-a"))
                assert hidden.status_code == unknown.status_code == 404
                assert hidden.json()["error"]["code"] == unknown.json()["error"]["code"] == "request_not_found"
                assert hidden.json()["error"]["message"].replace(theirs, "ID") == unknown.json()["error"][
                    "message"
                ].replace("req_no_such_request", "ID")
            assert reads(http, theirs, bearer("key-a")) == [404, 404, 404]
            assert reads(http, mine, bearer("key-b")) == [404, 404, 404]
            assert reads(http, theirs, bearer("key-b")) == [200, 200, 200]

            assert reads(http, mine, bearer(ADMIN_TOKEN)) == [200, 200, 200]  # the admin reads all
            assert reads(http, theirs, bearer(ADMIN_TOKEN)) == [200, 200, 200]
            wrong = http.get(f"/v1/requests/{mine}", headers=bearer("key-c"))
            assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_admin_token"
            assert http.get(f"/v1/requests/{mine}").status_code == 401


def test_keys_without_an_admin_token_still_read_their_own(database_url: str, sim_pair: list[WorkerProcess]) -> None:
    with running_gateway(database_url, sim_pair, api_keys=KEYS) as gateway:
        mine = served(gateway, "key-a")
        with gateway.http() as http:
            assert reads(http, mine, bearer("key-a")) == [200, 200, 200]
            assert reads(http, mine, bearer("key-b")) == [404, 404, 404]
            refused = http.get(f"/v1/requests/{mine}", headers=bearer("not-a-key"))
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"


def test_a_tenants_events_are_checked_against_the_log_not_the_requests_row(
    database_url: str, sim_pair: list[WorkerProcess]
) -> None:
    """docs/design.md §8 lets the read models trail the log: with the request's row not there (yet),
    its events and its page, which read the log, still answer its tenant and no other;
    the summary, which is the row, answers 404 (docs/read-models.md)."""
    with running_gateway(database_url, sim_pair, api_keys=KEYS) as gateway:
        mine = served(gateway, "key-a")
        assert execute_sql(database_url, "DELETE FROM requests WHERE request_id = :id", id=mine) == 1
        with gateway.http() as http:
            assert reads(http, mine, bearer("key-a")) == [404, 200, 200]
            assert reads(http, mine, bearer("key-b")) == [404, 404, 404]


def test_an_open_gateway_without_an_admin_token_keeps_its_audit_closed(
    database_url: str, sim_pair: list[WorkerProcess]
) -> None:
    with running_gateway(database_url, sim_pair) as gateway:
        request_id = served(gateway, "anything")
        with gateway.http() as http:
            answer = http.get(f"/v1/requests/{request_id}", headers=bearer("anything"))
            assert answer.status_code == 403 and answer.json()["error"]["code"] == "admin_disabled"
