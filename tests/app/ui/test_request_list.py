"""``/ui/requests`` over real HTTP: a real gateway on a real log, requests recorded by real
sim workers for two tenants and checked-in traces, each page checked against SQL.

The filters (outcome, model, tenant, error code, migration, time) must select exactly
the rows the same condition selects in SQL; keyset paging must give every row once, in
the order ``accepted_at DESC, request_id DESC`` (the traces share one ``accepted_at``,
so the tie on it is paged too). The token handoff swaps ``?token=`` for a cookie that
only the pages accept. In headless Chromium (as the timeline page's test, skipped without
a browser unless ``PHASEGATE_REQUIRE_CHROMIUM`` is set) the printed kind of URL opens the
list, a click opens a timeline, and a screenshot goes to artifacts/ui/requests.png.
"""

from __future__ import annotations

import html
import os
import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest

from app.incident.trace_io import import_trace
from statemachine.trace import parse_trace
from tests.app.conftest import add_fault
from tests.app.driver.test_failover import FAST
from tests.conftest import run_sync
from tests.support.audit import fetch_sql
from tests.support.chromium import Chromium, find_chromium
from tests.support.gateway import MODEL, RunningGateway, running_gateway
from tests.support.workers import WorkerProcess

TRACES = Path(__file__).resolve().parents[2] / "traces"
ARTIFACTS = Path(__file__).resolve().parents[3] / "artifacts" / "ui"
TOKEN = "list-admin-token"
ADMIN = {"authorization": f"Bearer {TOKEN}"}
KEYS = {"key-acme": "acme", "key-globex": "globex"}
ORDER = "ORDER BY accepted_at DESC, request_id DESC"


@pytest.fixture
def gateway(database_url: str, sim_pair: list[WorkerProcess]) -> Iterator[RunningGateway]:
    for path in sorted(TRACES.glob("*.jsonl")):
        trace = parse_trace(path.read_text().splitlines())
        run_sync(lambda trace=trace, path=path: import_trace(database_url, trace, name=str(path)))
    for worker in sim_pair:
        httpx.delete(worker.base_url + "/admin/faults")
        # the prompt "retry me" stalls on its first attempt: fenced, then migrated to the other worker
        add_fault(worker, action="stall", at_token=0, match={"prompt_contains": "retry me", "attempt": 1})
    with running_gateway(database_url, sim_pair, admin_token=TOKEN, api_keys=KEYS, timeouts=FAST) as running:
        for key, prompt in [
            ("key-acme", "hello"),
            ("key-acme", "retry me"),
            ("key-globex", "hi"),
            ("key-globex", "yo"),
        ]:
            running.openai(api_key=key).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=4
            )
        running.settle()
        yield running


def listed(page: httpx.Response) -> list[str]:
    assert page.status_code == 200, page.text
    return [html.unescape(found) for found in re.findall(r'<tr data-request="([^"]+)"', page.text)]


def every_page(http: httpx.Client, query: str) -> tuple[list[str], int]:
    """Follow the "older" links from the first page: every id listed, and how many pages."""
    ids: list[str] = []
    url: str | None = f"/ui/requests?{query}"
    pages = 0
    while url is not None:
        page = http.get(url)
        ids += listed(page)
        pages += 1
        found = re.search(r'<a class="next" href="([^"]+)"', page.text)
        url = html.unescape(found.group(1)) if found else None
    return ids, pages


def sql_ids(database_url: str, where: str = "true", **params: object) -> list[str]:
    return [
        row["request_id"]
        for row in fetch_sql(database_url, f"SELECT request_id FROM requests WHERE {where} {ORDER}", **params)
    ]


def test_filters_and_keyset_pages_match_sql(gateway: RunningGateway, database_url: str) -> None:
    everything = sql_ids(database_url)
    traces = len(list(TRACES.glob("*.jsonl")))  # the golden traces, and four live requests
    assert len(everything) == traces + 4
    with gateway.http(headers=ADMIN) as http:
        ids, pages = every_page(http, "limit=2")
        assert ids == everything and pages == (traces + 5) // 2  # each row once, newest first, ties broken by id
        assert every_page(http, "limit=3&outcome=failed")[0] == sql_ids(database_url, "outcome = 'failed'")
        assert listed(http.get("/ui/requests?outcome=unfinished")) == sql_ids(database_url, "outcome IS NULL")
        assert listed(http.get("/ui/requests?tenant=acme")) == sql_ids(database_url, "tenant = 'acme'")
        assert len(listed(http.get("/ui/requests?tenant=acme"))) == 2
        assert listed(http.get(f"/ui/requests?model={MODEL}&tenant=globex")) == sql_ids(
            database_url, "model = :m AND tenant = 'globex'", m=MODEL
        )
        interrupted = listed(http.get("/ui/requests?error_code=upstream_decode_interrupted"))
        assert interrupted == sql_ids(database_url, "error_code = 'upstream_decode_interrupted'") != []
        # a migration: more than one attempt, or one of a kind the policy decided
        migrated = listed(http.get("/ui/requests?migration=any"))
        assert migrated == sql_ids(database_url, "attempts > 1")
        assert listed(http.get("/ui/requests?migration=none")) == sql_ids(database_url, "attempts <= 1")
        retried = listed(http.get("/ui/requests?migration=prefill_retry"))
        assert retried == sql_ids(
            database_url,
            "EXISTS (SELECT 1 FROM request_events e WHERE e.request_id = requests.request_id"
            " AND e.type = 'Decided' AND e.body->'params'->>'migration' = 'prefill_retry')",
        )
        live_retry = sql_ids(database_url, "tenant = 'acme' AND attempts = 2")
        assert len(live_retry) == 1 and live_retry[0] in retried and {"req_retried", "req_fenced"} <= set(retried)
        # only the poison trace's retry followed a refused start (a 500)
        assert listed(http.get("/ui/requests?migration=new_request")) == ["req_poison"]
        # time: the traces were accepted on 2026-11-30 at noon, the live requests now
        noon = "2026-11-30T12:00:00Z"
        recent = (datetime.now(UTC) - timedelta(minutes=10)).isoformat()
        assert listed(http.get("/ui/requests", params={"since": recent})) == sql_ids(
            database_url, "accepted_at >= now() - interval '10 minutes'"
        )
        assert len(listed(http.get("/ui/requests", params={"since": noon, "until": "2026-11-30T12:00:01Z"}))) == traces
        # each row links to its timeline page, which opens
        page = http.get("/ui/requests?outcome=failed")
        link = html.unescape(re.findall(r'<td class="id"><a href="([^"]+)"', page.text)[0])
        assert http.get(link).status_code == 200 and "<svg" in http.get(link).text
        # what cannot be used is refused, naming the parameter
        for query, param in [
            ("outcome=lost", "outcome"),
            ("migration=sideways", "migration"),
            ("since=yesterday", "since"),
            ("since=2026-11-30T12:00:00", "since"),  # no time zone
            ("limit=0", "limit"),
            ("limit=501", "limit"),
            ("before=bm9wZQ", "before"),
        ]:
            refused = http.get(f"/ui/requests?{query}")
            assert refused.status_code == 400, query
            assert refused.json()["error"]["param"] == param


def test_the_token_in_the_url_becomes_a_cookie_for_the_pages_only(gateway: RunningGateway) -> None:
    with gateway.http() as http:
        assert http.get("/ui/requests").status_code == 401
        assert http.get("/ui/requests?token=wrong").status_code == 401
        handed = http.get("/ui/requests?token=" + TOKEN + "&outcome=failed")
        assert handed.status_code == 303
        assert handed.headers["location"] == "/ui/requests?outcome=failed"  # the token is gone from the URL
        assert handed.headers["referrer-policy"] == "no-referrer"
        cookie = handed.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/ui/" in cookie
        assert TOKEN not in cookie  # the cookie stands for the token; it is not the token
        assert listed(http.get(handed.headers["location"])) != []  # httpx kept the cookie
        assert http.get("/ui/requests/req_clean").status_code == 200
        # the JSON endpoints still want the token itself: a cookie is sent by any page's request
        assert http.get("/v1/requests/req_clean").status_code == 401
        http.cookies.clear()
        http.cookies.set("phasegate_admin", "0" * 64, domain="127.0.0.1", path="/ui/")
        assert http.get("/ui/requests").status_code == 401


def test_without_an_admin_token_the_list_is_disabled(database_url: str) -> None:
    with running_gateway(database_url, []) as gateway, gateway.http() as http:
        for url in ("/ui/requests", "/ui/requests?token=anything"):
            refused = http.get(url)
            assert refused.status_code == 403 and refused.json()["error"]["code"] == "admin_disabled"


@pytest.fixture(scope="module")
def chromium() -> str:
    found = find_chromium()
    if found is None:
        if os.environ.get("PHASEGATE_REQUIRE_CHROMIUM"):
            pytest.fail("PHASEGATE_REQUIRE_CHROMIUM is set but no chromium was found (run .ci/chromium)")
        pytest.skip("no chromium (install it with .ci/chromium)")
    return found


ROWS = """(() => ({
  href: location.href, cookie: document.cookie, title: document.title,
  rows: [...document.querySelectorAll('table.requests tr[data-request]')].map(tr => {
    const r = tr.getBoundingClientRect();
    return {id: tr.dataset.request, outcome: tr.querySelector('td.outcome').textContent,
            link: tr.querySelector('td.id a').getAttribute('href'), height: r.height, width: r.width};
  }),
  form: [...document.querySelectorAll('form [name]')].map(e => e.name),
}))()"""


def test_the_printed_url_opens_the_list_in_a_browser(chromium: str, gateway: RunningGateway) -> None:
    with Chromium.launch(chromium) as browser:
        page = browser.new_page()  # no Authorization header: the token comes in the URL, once
        page.goto(f"{gateway.url}/ui/requests?token={TOKEN}")
        shown = page.evaluate(ROWS)
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        (ARTIFACTS / "requests.png").write_bytes(page.screenshot())
        assert shown["href"] == f"{gateway.url}/ui/requests"  # the token left the address bar
        assert shown["cookie"] == ""  # HttpOnly: no script on the page reads it
        assert shown["title"].startswith("Requests")
        assert [row["id"] for row in shown["rows"]][:4] == [r for r in listed_ids(gateway)][:4]
        assert all(row["height"] > 0 and row["width"] > 0 for row in shown["rows"])
        assert {"outcome", "model", "tenant", "migration", "since", "until"} <= set(shown["form"])
        # the filter form and a click through to a timeline, on the cookie alone
        page.goto(f"{gateway.url}/ui/requests?outcome=failed")
        failed = page.evaluate(ROWS)["rows"]
        assert failed and all(row["outcome"].startswith("failed") for row in failed)
        page.evaluate("document.querySelector('td.id a').click()")
        browser.wait_for("Page.loadEventFired", session=page.session)
        timeline = page.evaluate("({title: document.title, svg: !!document.querySelector('svg.timeline')})")
        assert timeline["title"].startswith(failed[0]["id"]) and timeline["svg"]
    assert (ARTIFACTS / "requests.png").stat().st_size > 10_000


def listed_ids(gateway: RunningGateway) -> list[str]:
    with gateway.http(headers=ADMIN) as http:
        return listed(http.get("/ui/requests"))
