"""Which SSE events carry an ``id:`` (docs/resume.md says the same): every delta, the finish
and a final error, numbered in order; the role chunk before the first delta (there is no
delta to resume after yet) and ``data: [DONE]`` carry none."""

from __future__ import annotations

from pathlib import Path

from tests.support.gateway import MODEL, RunningGateway

DOC = Path(__file__).resolve().parents[3] / "docs" / "resume.md"


def test_the_events_without_an_id_are_the_role_chunk_and_done(gateway: RunningGateway) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True}
    with gateway.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as response:
        events = [block for block in response.read().decode().split("\n\n") if block.strip()]
    without = [block for block in events if not block.startswith("id: ")]
    assert len(without) == 2 and '"role":"assistant"' in without[0] and without[1] == "data: [DONE]", without
    assert events[0] == without[0] and events[-1] == "data: [DONE]"
    ids = [int(block.split("\n", 1)[0].removeprefix("id: ")) for block in events if block.startswith("id: ")]
    assert ids == list(range(len(ids))) and len(ids) >= 6  # five deltas, then the finish
    assert "the role chunk" in DOC.read_text() and "`[DONE]`" in DOC.read_text()
