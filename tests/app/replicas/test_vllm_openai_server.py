"""vLLM's own OpenAI server (a plain replica), as the tests run it and the gateway probes it.

The server is the run's shared one (tests/support/vllm_replicas.py); that its whole
process group dies with it is checked where it is stopped, at the end of the run.
"""

from __future__ import annotations

import json

import pytest

from app.replicas.base import ProbeAnswer
from app.replicas.openai_upstream import OpenAIUpstream
from app.replicas.worker_client import http_client
from tests.support.vllm_replicas import MODEL, SharedVllm


@pytest.mark.vllm
async def test_the_plain_vllm_server_streams_and_answers_the_gateways_probe(vllm: SharedVllm) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
    }
    async with (
        http_client(timeout=60) as http,
        http.stream("POST", vllm.server_url + "/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200
        events = [line[6:] async for line in response.aiter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    # the gateway's probe of such a replica: a real generation, and the load vLLM reports
    upstream = OpenAIUpstream("vllm", vllm.server_url, health_model=MODEL, response_timeout_s=30)
    try:
        assert await upstream.health() is ProbeAnswer.HEALTHY
        assert upstream.reported_load == 0  # idle now: vLLM's running and waiting counts, read
    finally:
        await upstream.close()
