"""Delivered tokens are tokens, delivered deltas are deltas (docs/design.md §11).

A sim worker that puts three engine tokens in each output (as vLLM's stream interval
does under load) streams through the gateway; the client counts deltas, the usage
counts tokens, and the log must say both, apart, also in the final error of a stream
cut short.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from statemachine import events as ev
from statemachine.state import fold
from tests.app.conftest import add_fault
from tests.support.gateway import MODEL, running_gateway
from tests.support.transcript import check_request, of, stream_chat
from tests.support.workers import WorkerProcess, running_worker

PER_DELTA = 3


@pytest.fixture(scope="module")
def batching_worker() -> Iterator[WorkerProcess]:
    args = ["--model", MODEL, "--sim-tokens-per-delta", str(PER_DELTA), "--sim-decode-ms-per-token", "3"]
    with running_worker(faults=True, args=args) as worker:
        yield worker


def test_a_completed_stream_logs_its_tokens_and_its_deltas_apart(
    database_url: str, batching_worker: WorkerProcess
) -> None:
    with running_gateway(database_url, [batching_worker]) as gateway:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "three at a time"}], "max_tokens": 30}
        body["stream_options"] = {"include_usage": True}
        with gateway.http() as http:
            raw = http.post("/v1/chat/completions", json={**body, "stream": True}).text
        chunks = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
        (usage,) = [chunk["usage"] for chunk in chunks if chunk.get("usage")]
        transcript = stream_chat(gateway.url, body)
        state = check_request(gateway.events(transcript.request_id), transcript)
        assert state.delivered_deltas == len(transcript.contents) == 10
        assert state.delivered_output_tokens == 30 == PER_DELTA * state.delivered_deltas
        assert usage["completion_tokens"] == 30  # what the engine says it generated


def test_a_stream_cut_short_reports_tokens_in_its_final_error(
    database_url: str, batching_worker: WorkerProcess
) -> None:
    prompt = "cut after four deltas"
    add_fault(batching_worker, action="die", point="after_frame", at_token=3, match={"prompt_contains": prompt})
    with running_gateway(database_url, [batching_worker]) as gateway:
        body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 60}
        transcript = stream_chat(gateway.url, body)
        events = gateway.events(transcript.request_id)
        assert transcript.error is not None and transcript.error["code"] == "upstream_decode_interrupted"
        (failed,) = of(events, ev.RequestFailed)
        deltas = len(transcript.contents)
        assert deltas == 4 == fold(events).delivered_deltas
        assert transcript.error["delivered_output_tokens"] == failed.delivered_output_tokens == PER_DELTA * deltas  # type: ignore[attr-defined]
