"""``Idempotency-Key`` (docs/design.md §12): one logical request per tenant and key.

Real gateway, real sim worker, real PostgreSQL, raw HTTP and the ``openai`` client.
A POST sent again with the same key and body attaches to the request the first one
started (its answer comes from the log, under its request id); another body is
refused; two POSTs racing for one key start one generation.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import asyncpg
import httpx
import pytest

from app.store.database import asyncpg_dsn
from ops.transcript import Transcript
from tests.support.gateway import MODEL, RunningGateway, running_gateway
from tests.support.workers import WorkerProcess, running_worker


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProcess]:
    with running_worker(args=["--model", MODEL, "--sim-decode-ms-per-token", "10"]) as w:
        yield w


def body(prompt: str, stream: bool, max_tokens: int = 12) -> dict[str, Any]:
    messages = [{"role": "user", "content": prompt}]
    return {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "stream": stream, "ignore_eos": True}


def post(gateway: RunningGateway, payload: dict[str, Any], key: str, **headers: str) -> tuple[httpx.Response, Any]:
    """POST and read the whole answer: a transcript when streamed, the JSON body otherwise."""
    with httpx.Client(base_url=gateway.url, timeout=60) as http:
        response = http.post("/v1/chat/completions", json=payload, headers={"idempotency-key": key, **headers})
    if response.status_code == 200 and payload.get("stream"):
        transcript = Transcript(response.headers["x-request-id"], 200)
        for line in response.text.splitlines():
            transcript.read(line)
        return response, transcript
    return response, response.json()


def generations(database_url: str, key: str) -> int:
    """Requests the gateway accepted with this key: each one a generation upstream."""

    async def count() -> int:
        connection = await asyncpg.connect(asyncpg_dsn(database_url))
        try:
            sql = "SELECT count(*) FROM request_events WHERE type = 'RequestAccepted' AND body->>'idempotency_key' = $1"
            return int(await connection.fetchval(sql, key))
        finally:
            await connection.close()

    return asyncio.run(count())


def test_a_streamed_post_sent_again_gets_the_same_answer_from_the_log(database_url: str, worker: WorkerProcess) -> None:
    with running_gateway(database_url, [worker]) as gateway:
        first, original = post(gateway, body("stream it", True), "key-stream-1")
        again, repeated = post(gateway, body("stream it", True), "key-stream-1")
        assert again.headers["x-request-id"] == first.headers["x-request-id"]
        assert repeated.contents == original.contents and repeated.done and repeated.error is None
        assert repeated.finish_reason == original.finish_reason == "length"
        _, tail = post(gateway, body("stream it", True), "key-stream-1", **{"last-event-id": "7"})
        assert tail.contents == original.contents[8:] and tail.event_ids[: len(tail.contents)] == list(range(8, 12))
        gateway.settle()
        assert generations(database_url, "key-stream-1") == 1


def test_a_whole_answer_posted_again_is_the_same_body(database_url: str, worker: WorkerProcess) -> None:
    with running_gateway(database_url, [worker]) as gateway:
        first, original = post(gateway, body("whole", False), "key-whole-1")
        again, repeated = post(gateway, body("whole", False), "key-whole-1")
        assert first.status_code == again.status_code == 200
        assert repeated == original  # the same JSON, id and created included
        assert again.headers["x-request-id"] == first.headers["x-request-id"]
        gateway.settle()
        assert generations(database_url, "key-whole-1") == 1


def test_a_refusal_by_the_replica_posted_again_is_the_same_refusal(database_url: str, worker: WorkerProcess) -> None:
    """The answer from the log says what the first did: the status the policy decided and the
    param the replica named (a worker takes a prompt as text or token ids, not as embeddings)."""
    embedded = {"model": MODEL, "prompt_embeds": "AAAA", "max_tokens": 2}
    with running_gateway(database_url, [worker]) as gateway, httpx.Client(base_url=gateway.url, timeout=60) as http:
        answers = [
            http.post("/v1/completions", json=embedded, headers={"idempotency-key": "key-refused"}) for _ in "ab"
        ]
    first, again = answers
    assert first.status_code == again.status_code == 400
    assert again.json() == first.json() and first.json()["error"]["param"] == "prompt_embeds"
    assert first.json()["error"]["code"] == "unsupported_parameter"


def test_a_key_used_again_with_another_body_is_refused(database_url: str, worker: WorkerProcess) -> None:
    with running_gateway(database_url, [worker]) as gateway:
        post(gateway, body("first body", False), "key-reused")
        refused, error = post(gateway, body("another body", False), "key-reused")
        assert refused.status_code == 422 and refused.headers["x-should-retry"] == "false"
        assert error["error"]["code"] == "idempotency_key_reused" and error["error"]["param"] == "Idempotency-Key"
        invalid, error = post(gateway, body("x", False), "k" * 256)
        assert invalid.status_code == 400 and error["error"]["code"] == "invalid_idempotency_key"
        gateway.settle()
        assert generations(database_url, "key-reused") == 1


def test_two_posts_racing_for_one_key_start_one_generation(database_url: str, worker: WorkerProcess) -> None:
    with running_gateway(database_url, [worker]) as gateway:
        answers: list[tuple[httpx.Response, Any]] = []
        threads = [
            threading.Thread(target=lambda: answers.append(post(gateway, body("race", True, 30), "key-race")))
            for _ in range(3)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert len({response.headers["x-request-id"] for response, _ in answers}) == 1
        assert len({tuple(transcript.contents) for _, transcript in answers}) == 1
        assert all(transcript.done and len(transcript.contents) == 30 for _, transcript in answers)
        gateway.settle()
        assert generations(database_url, "key-race") == 1


def test_keys_are_per_tenant_and_the_openai_client_can_send_one(database_url: str, worker: WorkerProcess) -> None:
    keys = {"key-of-acme-0123456789": "acme", "key-of-globex-0123456789": "globex"}
    with running_gateway(database_url, [worker], api_keys=keys) as gateway:
        answers = []
        for api_key in ("key-of-acme-0123456789", "key-of-acme-0123456789", "key-of-globex-0123456789"):
            client = gateway.openai(api_key=api_key)
            response = client.chat.completions.with_raw_response.create(
                model=MODEL,
                messages=[{"role": "user", "content": "per tenant"}],
                max_tokens=6,
                extra_headers={"Idempotency-Key": "key-shared"},
            )
            answers.append((response.headers["x-request-id"], response.parse().choices[0].message.content))
        (acme_id, acme_text), (again_id, again_text), (globex_id, _) = answers
        assert (again_id, again_text) == (acme_id, acme_text)  # attached
        assert globex_id != acme_id  # another tenant's key of the same name is another request
        gateway.settle()
        assert generations(database_url, "key-shared") == 2
