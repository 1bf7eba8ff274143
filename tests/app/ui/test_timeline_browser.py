"""The timeline page in headless Chromium: a retried and an interrupted request, served by a
real gateway over real sim workers, drawn as the log says. Screenshots go to artifacts/ui/.

Chromium comes from Debian (``.ci/chromium``). Without it this test skips, unless
``PHASEGATE_REQUIRE_CHROMIUM`` is set (CI sets it), when a missing browser fails it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest

from statemachine import events as ev
from tests.app.conftest import add_fault
from tests.app.driver.test_failover import FAST, stream_text
from tests.support.chromium import Chromium, find_chromium
from tests.support.gateway import MODEL, RunningGateway, running_gateway
from tests.support.workers import WorkerProcess

ARTIFACTS = Path(__file__).resolve().parents[3] / "artifacts" / "ui"
TOKEN = "ui-test-token"

# Every mark as the browser laid it out, relative to the SVG, and the lanes' label heights.
LAYOUT = """(() => {
  const svg = document.querySelector('svg.timeline');
  const box = svg.getBoundingClientRect();
  const marks = [...svg.querySelectorAll('[data-mark]')].map(g => {
    const r = g.getBoundingClientRect();
    return {mark: g.dataset.mark, attempt: g.dataset.attempt || null, seq: Number(g.dataset.seq),
            ended: g.dataset.ended || null, x: r.left - box.left, right: r.right - box.left,
            top: r.top - box.top, bottom: r.bottom - box.top, width: r.width, height: r.height,
            title: g.querySelector('title').textContent};
  });
  const lanes = [...svg.querySelectorAll('text.lane-name')].map(
    t => ({name: t.textContent, top: t.getBoundingClientRect().top - box.top}));
  return {width: box.width, height: box.height, marks, lanes,
          verdict: document.querySelector('.verdict').textContent, title: document.title};
})()"""


@pytest.fixture(scope="module")
def chromium() -> str:
    found = find_chromium()
    if found is None:
        if os.environ.get("PHASEGATE_REQUIRE_CHROMIUM"):
            pytest.fail("PHASEGATE_REQUIRE_CHROMIUM is set but no chromium was found (run .ci/chromium)")
        pytest.skip("no chromium (install it with .ci/chromium)")
    return found


def interrupted(gateway: RunningGateway, prompt: str) -> str:
    stream = gateway.openai().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], stream=True, max_tokens=20
    )
    with stream, pytest.raises(openai.APIError) as caught:
        for _ in stream:
            pass
    assert caught.value.code == "upstream_decode_interrupted"
    return str(stream.response.headers["x-request-id"])


def draw(browser: Chromium, gateway: RunningGateway, request_id: str, name: str) -> dict[str, Any]:
    page = browser.new_page(headers={"Authorization": f"Bearer {TOKEN}"})
    page.goto(f"{gateway.url}/ui/requests/{request_id}")
    layout: dict[str, Any] = page.evaluate(LAYOUT)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / f"timeline-{name}.png").write_bytes(page.screenshot())
    return layout


def lane_of(layout: dict[str, Any], mark: dict[str, Any]) -> str:
    """The lane whose band holds the mark's middle."""
    middle = (mark["top"] + mark["bottom"]) / 2
    above = [lane for lane in layout["lanes"] if lane["top"] - 12 <= middle]
    return str(above[-1]["name"])


def only(layout: dict[str, Any], kind: str, attempt: str | None = None) -> dict[str, Any]:
    (found,) = [m for m in layout["marks"] if m["mark"] == kind and (attempt is None or m["attempt"] == attempt)]
    return dict(found)


def check_drawn(layout: dict[str, Any]) -> None:
    """Every mark was laid out, inside the picture, in the lane it belongs to."""
    for mark in layout["marks"]:
        assert mark["width"] > 0 and mark["height"] > 0, mark
        assert mark["x"] >= -12 and mark["right"] <= layout["width"] + 12, mark
        if mark["attempt"] and mark["mark"] != "commit-point" and not mark["mark"].startswith("client"):
            assert lane_of(layout, mark) == f"attempt {mark['attempt']}", mark


def test_the_page_draws_a_retried_and_an_interrupted_request(
    chromium: str, database_url: str, sim_pair: list[WorkerProcess], unique_prompt: Callable[[str], str]
) -> None:
    retry_prompt, cut_prompt = unique_prompt("fence then retry me"), unique_prompt("cut me off")
    for worker in sim_pair:  # attempt 1 stalls in prefill: fenced, then retried elsewhere
        add_fault(worker, action="stall", at_token=0, match={"prompt_contains": retry_prompt, "attempt": 1})
        add_fault(worker, action="stall", at_token=2, match={"prompt_contains": cut_prompt})  # stalls mid-answer
    with running_gateway(database_url, sim_pair, timeouts=FAST, admin_token=TOKEN) as gateway:
        retried_id, text, _ = stream_text(gateway, retry_prompt)
        cut_id = interrupted(gateway, cut_prompt)
        retried_events, cut_events = gateway.events(retried_id), gateway.events(cut_id)
        with Chromium.launch(chromium) as browser:
            retried = draw(browser, gateway, retried_id, "retried")
            cut = draw(browser, gateway, cut_id, "interrupted")

    # the retried request: two attempt lanes; the first fenced and released before the second
    # started, left of the commit point; everything the client got came after it
    assert text and retried["title"].startswith(retried_id)
    assert "no divergence" in retried["verdict"]
    assert [lane["name"] for lane in retried["lanes"]] == ["policy", "attempt 1", "attempt 2", "client"]
    check_drawn(retried)
    first, second = only(retried, "attempt", "1"), only(retried, "attempt", "2")
    assert first["ended"] == "cancel_acked" and second["ended"] == "completed"
    fence, released = only(retried, "fence", "1"), only(retried, "released", "1")
    commit = only(retried, "commit-point")
    assert commit["attempt"] == "2"
    # its first failure is the stall's (a loaded machine may add one, a renewal that timed out)
    failure, *_ = [m for m in retried["marks"] if m["mark"] == "failure" and m["attempt"] == "1"]
    assert failure["x"] < fence["right"] <= released["right"] <= only(retried, "start", "2")["right"]
    assert released["x"] < commit["x"]
    deliveries = [m for m in retried["marks"] if m["mark"] == "client-delivery"]
    assert deliveries and all(m["x"] > commit["x"] and m["attempt"] == "2" for m in deliveries)
    assert sum(e.tokens for e in retried_events if isinstance(e, ev.DeltasDelivered)) > 0  # type: ignore[attr-defined]
    assert "liveness_uncertain" in failure["title"]

    # the interrupted request: one attempt; its failure comes after the commit point, and the
    # request failed with upstream_decode_interrupted instead of a second attempt
    assert [lane["name"] for lane in cut["lanes"]] == ["policy", "attempt 1", "client"]
    check_drawn(cut)
    commit = only(cut, "commit-point")
    failure = only(cut, "failure", "1")
    assert failure["x"] > commit["x"]
    assert "upstream_decode_interrupted" in only(cut, "request-failed")["title"]
    assert only(cut, "request-failed")["x"] > commit["x"]
    assert {m["mark"] for m in cut["marks"] if m["attempt"] == "1"} >= {"fence", "cancel-sent", "delivery"}
    assert not [e for e in cut_events if isinstance(e, ev.AttemptStarted) and e.attempt > 1]  # type: ignore[attr-defined]
    assert (ARTIFACTS / "timeline-retried.png").stat().st_size > 10_000
    assert (ARTIFACTS / "timeline-interrupted.png").stat().st_size > 10_000
