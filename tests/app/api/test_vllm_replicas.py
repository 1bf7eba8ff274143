"""The gateway in front of real vLLM: a worker with the vLLM engine, and vLLM's own
OpenAI server as a plain replica, both on the tiny local model (see .ci/vllm-env).

The failover test kills the worker, so it runs last in this module.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from contextlib import AbstractContextManager

import openai
import pytest

from app.config import ReplicaConfig, Timeouts
from statemachine import events as ev
from statemachine.replay import replay
from statemachine.request_state import Outcome
from statemachine.state import fold
from tests.app.conftest import add_fault
from tests.support.gateway import RunningGateway, running_gateway
from tests.support.workers import WorkerProcess, running_vllm_openai_server, start_worker, vllm_env

pytestmark = pytest.mark.vllm

MODEL = "tiny-llama"
MESSAGES = [{"role": "user", "content": "hello there, tell me a story"}]
TIMEOUTS = Timeouts(
    stall_s=10.0, lease_ttl_s=3.0, first_token_soft_s=10.0, first_token_hard_s=60.0, upstream_response_s=30.0
)


@pytest.fixture(scope="module")
def vllm_pair() -> Iterator[tuple[WorkerProcess, str]]:
    """A vLLM worker (faults on) and vLLM's OpenAI server, started side by side."""
    env = vllm_env()
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        worker_future = pool.submit(
            start_worker,
            engine="vllm",
            python=env.python,
            model_path=env.model,
            faults=True,
            args=["--model", MODEL, "--vllm-args", '{"enforce_eager": true}'],
            ready_timeout=300.0,
        )
        with running_vllm_openai_server(env, served_model_name=MODEL, args=["--enforce-eager"]) as (_, server_url):
            worker = worker_future.result()
            try:
                yield worker, server_url
            finally:
                worker.kill()


def gateway_over(database_url: str, vllm_pair: tuple[WorkerProcess, str]) -> AbstractContextManager[RunningGateway]:
    worker, server_url = vllm_pair
    replicas = [
        ReplicaConfig(id="a-worker", url=worker.base_url, kind="worker"),
        ReplicaConfig(id="b-server", url=server_url, kind="openai"),
    ]
    return running_gateway(database_url, replicas, models={MODEL: "tiny-rev"}, timeouts=TIMEOUTS)


def ask(client: openai.OpenAI, *, stream: bool) -> tuple[str, str]:
    if stream:
        chunks = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, stream=True, max_tokens=16, temperature=0
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return chunks.response.headers["x-request-id"], text
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0)
    return raw.headers["x-request-id"], raw.parse().choices[0].message.content or ""


def served_by(gateway: RunningGateway, request_id: str) -> list[str]:
    return [e.replica_id for e in gateway.events(request_id) if isinstance(e, ev.AttemptStarted)]


def test_both_vllm_replica_kinds_serve_streamed_and_whole_answers(
    database_url: str, vllm_pair: tuple[WorkerProcess, str]
) -> None:
    with gateway_over(database_url, vllm_pair) as gateway:
        client = gateway.openai(timeout=120.0)
        answers: dict[str, set[str]] = {}
        for stream in (True, False, True, False):
            request_id, text = ask(client, stream=stream)
            (replica,) = served_by(gateway, request_id)
            answers.setdefault(replica, set()).add(text)
            events = gateway.events(request_id)
            assert fold(events).outcome is Outcome.COMPLETED and replay(events).ok
            assert "".join(e.text or "" for e in events if isinstance(e, ev.DeltasDelivered)) == text
        assert set(answers) == {"a-worker", "b-server"}  # both kinds took requests
        assert all(len(texts) == 1 and "" not in texts for texts in answers.values())  # temperature 0


def test_a_vllm_worker_dying_before_the_first_delta_is_retried_on_the_vllm_server(
    database_url: str, vllm_pair: tuple[WorkerProcess, str]
) -> None:
    worker, _ = vllm_pair
    with gateway_over(database_url, vllm_pair) as gateway:
        client = gateway.openai(timeout=120.0)
        reference_id, reference = ask(client, stream=True)
        if served_by(gateway, reference_id) != ["b-server"]:
            reference_id, reference = ask(client, stream=True)  # the next one goes to the server
        assert served_by(gateway, reference_id) == ["b-server"]
        add_fault(worker, action="die", point="before_frame", at_token=0, match={"attempt": 1})
        request_id, text = ask(client, stream=True)
        assert served_by(gateway, request_id) == ["a-worker", "b-server"]
        assert text == reference  # one clean answer: the server's own
        events = gateway.events(request_id)
        assert {e.attempt for e in events if isinstance(e, ev.DeltasDelivered)} == {2}
        assert replay(events).ok
