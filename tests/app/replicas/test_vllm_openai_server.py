"""The test helper that runs vLLM's own OpenAI server (a plain replica, for the gateway's tests)."""

from __future__ import annotations

import json
import os
import time

import pytest

from app.replicas.base import ProbeAnswer
from app.replicas.openai_upstream import OpenAIUpstream
from app.replicas.worker_client import http_client
from tests.support.workers import running_vllm_openai_server, vllm_env


@pytest.mark.vllm
async def test_the_plain_vllm_server_streams_and_its_whole_group_dies_with_it():
    env = vllm_env()
    with running_vllm_openai_server(env, args=["--enforce-eager"]) as (process, base_url):
        body = {
            "model": "tiny-llama",
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 8,
            "temperature": 0,
            "stream": True,
        }
        async with (
            http_client(timeout=60) as http,
            http.stream("POST", base_url + "/v1/chat/completions", json=body) as response,
        ):
            assert response.status_code == 200
            events = [line[6:] async for line in response.aiter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        # the gateway's probe of such a replica: a real generation, and the load vLLM reports
        upstream = OpenAIUpstream("vllm", base_url, health_model="tiny-llama", response_timeout_s=30)
        try:
            assert await upstream.health() is ProbeAnswer.HEALTHY
            assert upstream.reported_load == 0  # idle now: vLLM's running and waiting counts, read
        finally:
            await upstream.close()
        pgid = process.pid
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)
