"""The usage so far in every chunk (``stream_options.continuous_usage_stats``, docs/compatibility.md),
through sim workers, real PostgreSQL and raw SSE.

Each chunk of a choice carries that choice's usage as vLLM's server sends it: the prompt's
tokens as the replica counted them (the sim counts a word a token), the tokens of the
choice's deltas so far, their sum; the stream ends with the replica's whole usage. The log
holds what makes it (docs/design.md §3: the prompt's count with each choice's first delta,
each delta's tokens), so a resumed reader, from the log on any instance or attached to the
live request, gets the same chunks (§12). A stream that did not ask is as it was, and so is
its log.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from app.config import ReplicaConfig
from statemachine import events as ev
from statemachine.jsonform import to_json
from statemachine.replay import replay
from statemachine.request_state import Outcome
from statemachine.state import fold
from tests.app.conftest import held
from tests.support.gateway import MODEL, RunningGateway, running_gateway
from tests.support.scripted_upstream import running_scripted_upstream
from tests.support.transcript import of
from tests.support.workers import WorkerProcess, running_worker

ASKED = {"include_usage": True, "continuous_usage_stats": True}
GRACE_S = 5.0


@pytest.fixture(scope="module")
def slow_worker() -> Iterator[WorkerProcess]:
    with running_worker(faults=True, args=["--model", MODEL, "--sim-decode-ms-per-token", "20"]) as worker:
        yield worker


def chat(prompt: str, max_tokens: int = 8, **fields: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": prompt}]
    return {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "ignore_eos": True, **fields}


Chunk = tuple[str | None, str]  # an SSE event's id (None: the role chunk has none) and its data


def streamed(
    url: str, path: str, body: dict[str, Any], *, leave_after: int | None = None
) -> tuple[str, list[Chunk], bool]:
    """POST a streamed request: its id, each event's id and data as sent (``[DONE]`` aside),
    and whether ``[DONE]`` came; hung up after ``leave_after`` events with ids."""
    with (
        httpx.Client(base_url=url, timeout=60) as http,
        http.stream("POST", path, json={**body, "stream": True}) as response,
    ):
        assert response.status_code == 200, response.read()
        chunks, done = read(response, leave_after)
        return response.headers["x-request-id"], chunks, done


def read(response: httpx.Response, leave_after: int | None = None) -> tuple[list[Chunk], bool]:
    chunks: list[Chunk] = []
    event_id: str | None = None
    for line in response.iter_lines():
        if line.startswith("id: "):
            event_id = line[4:]
        elif line == "data: [DONE]":
            return chunks, True
        elif line.startswith("data: "):
            chunks.append((event_id, line[6:]))
            event_id = None
            if leave_after is not None and sum(1 for n, _ in chunks if n is not None) >= leave_after:
                return chunks, False
    return chunks, False


def resumed(url: str, request_id: str, after: int | None) -> list[Chunk]:
    headers = {} if after is None else {"last-event-id": str(after)}
    with (
        httpx.Client(base_url=url, timeout=60) as http,
        http.stream("GET", f"/v1/requests/{request_id}/stream", headers=headers) as response,
    ):
        assert response.status_code == 200, response.read()
        chunks, done = read(response)
    assert done
    return chunks


def usages(chunks: list[Chunk]) -> tuple[dict[int, list[dict[str, int]]], dict[str, Any]]:
    """Each choice's chunks' usage in order, and the stream's last chunk's (no choices)."""
    bodies = [json.loads(data) for _, data in chunks]
    *with_choices, last = bodies
    assert last["choices"] == [] and all(len(body["choices"]) == 1 for body in with_choices)
    per_choice: dict[int, list[dict[str, int]]] = {}
    for body in with_choices:
        per_choice.setdefault(body["choices"][0]["index"], []).append(body["usage"])
    return per_choice, last["usage"]


def assert_so_far(per_choice: dict[int, list[dict[str, int]]], prompts: dict[int, int]) -> None:
    """vLLM's usage so far: the choice's prompt in every chunk, its completion tokens from 0
    (the role chunk's, a chat's) growing a token a delta (the sim's), their sum."""
    assert sorted(per_choice) == sorted(prompts)
    for choice, said in per_choice.items():
        assert {u["prompt_tokens"] for u in said} == {prompts[choice]}
        assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in said)
        so_far = [u["completion_tokens"] for u in said]
        assert so_far == sorted(so_far) and so_far[-1] > 0
        assert all(set(u) == {"prompt_tokens", "total_tokens", "completion_tokens"} for u in said)


def test_every_chunk_of_a_chat_carries_its_choices_usage_so_far(gateway: RunningGateway) -> None:
    request_id, chunks, done = streamed(
        gateway.url, "/v1/chat/completions", chat("count four words", n=2, stream_options=ASKED)
    )
    assert done
    per_choice, whole = usages(chunks)
    assert_so_far(per_choice, {0: 4, 1: 4})  # "user: count four words": four words, four tokens
    for said in per_choice.values():  # the role chunk, then a token a delta, then the finish
        assert [u["completion_tokens"] for u in said] == [0, *range(1, 9), 8]
    assert whole["prompt_tokens"] == 4 and whole["completion_tokens"] == 16  # the replica's, whole
    events = gateway.events(request_id)
    accepted = events[0]
    assert isinstance(accepted, ev.RequestAccepted) and accepted.continuous_usage
    counted = [pair for e in of(events, ev.DeltasDelivered) for pair in e.prompt_tokens]  # type: ignore[attr-defined]
    assert sorted(counted) == [(0, 4), (1, 4)]  # said once a choice, with its first delta
    assert replay(events).ok


def test_a_batch_of_completions_counts_each_prompt_for_its_own_choices(gateway: RunningGateway) -> None:
    body = {"model": MODEL, "prompt": ["one two three", "four"], "max_tokens": 5, "ignore_eos": True}
    request_id, chunks, done = streamed(gateway.url, "/v1/completions", {**body, "stream_options": ASKED})
    assert done
    per_choice, whole = usages(chunks)
    assert_so_far(per_choice, {0: 3, 1: 1})  # vLLM's: each chunk, its own prompt's count
    assert whole["prompt_tokens"] == 4 and whole["completion_tokens"] == 10  # the batch's, whole
    assert fold(gateway.events(request_id)).outcome is Outcome.COMPLETED


def test_through_an_openai_replica_the_counts_are_the_replicas(database_url: str) -> None:
    """The replica is asked for the usage in every chunk only by a request that asked: its
    prompt count, each chunk's growth of its count (a word is two tokens there) and its
    usage at the end (with its details) are what the client gets."""
    question = {"model": MODEL, "messages": [{"role": "user", "content": "a question of many words"}], "max_tokens": 4}
    with (
        running_scripted_upstream() as upstream,
        running_gateway(database_url, [ReplicaConfig(id="u1", url=upstream.base_url, kind="openai")]) as gateway,
    ):
        request_id, chunks, done = streamed(gateway.url, "/v1/chat/completions", {**question, "stream_options": ASKED})
        assert done and (upstream.last_body or {})["stream_options"] == ASKED
        per_choice, whole = usages(chunks)
        # the role chunk's 0, two tokens a word, the finish's count the replica's (its end of sequence)
        assert [u["completion_tokens"] for u in per_choice[0]] == [0, 2, 4, 6, 8, 9]
        assert {u["prompt_tokens"] for u in per_choice[0]} == {3}  # the replica's count, not an estimate
        assert whole == {
            "prompt_tokens": 3,
            "completion_tokens": 9,
            "total_tokens": 12,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        events = gateway.events(request_id)
        tokens = [d[2] for e in of(events, ev.DeltasDelivered) for d in e.deltas]  # type: ignore[attr-defined]
        assert tokens == [2, 2, 2, 2]  # each delta's, as the replica counted it
        assert resumed(gateway.url, request_id, None) == chunks
        _, plain, done = streamed(
            gateway.url, "/v1/chat/completions", {**question, "stream_options": {"include_usage": True}}
        )
        assert done and (upstream.last_body or {})["stream_options"] == {"include_usage": True}  # asked no more
        assert [json.loads(data).get("usage") for _, data in plain][:-1] == [None] * (len(plain) - 1)


def test_a_stream_that_did_not_ask_and_its_log_are_as_before(gateway: RunningGateway) -> None:
    for options in ({"include_usage": True}, {"include_usage": False, "continuous_usage_stats": True}, None):
        body = chat("not asked", 4) if options is None else chat("not asked", 4, stream_options=options)
        request_id, chunks, done = streamed(gateway.url, "/v1/chat/completions", body)
        assert done
        bodies = [json.loads(data) for _, data in chunks]
        usage_chunks = [b for b in bodies if b.get("usage")]
        if options is not None and options["include_usage"]:
            assert usage_chunks == [bodies[-1]] and bodies[-1]["choices"] == []  # at the end only
            assert all("usage" in b and b["usage"] is None for b in bodies[:-1])
        else:
            assert usage_chunks == [] and all("usage" not in b for b in bodies)
        forms = [to_json(e) for e in gateway.events(request_id)]  # each event written as before
        accepted = forms[0]
        assert accepted["v"] < 5 and "continuous_usage" not in accepted["body"]
        assert all("prompt_tokens" not in f["body"] for f in forms if f["type"] == "DeltasDelivered")


def test_a_reader_resuming_from_the_log_on_another_instance_gets_the_same_chunks(
    database_url: str, slow_worker: WorkerProcess
) -> None:
    with (
        running_gateway(database_url, [slow_worker]) as first,
        running_gateway(database_url, [slow_worker]) as second,
    ):
        for path, body, afters in (
            ("/v1/chat/completions", chat("resume two", 6, n=2, stream_options=ASKED), ()),
            ("/v1/chat/completions", chat("resume me", 10, stream_options=ASKED), (0, 3, 5)),
            (
                "/v1/completions",
                {"model": MODEL, "prompt": "resume me too", "max_tokens": 6, "stream_options": ASKED},
                (0, 3, 5),
            ),
        ):
            request_id, whole, done = streamed(first.url, path, body)
            assert done
            first.settle()
            assert resumed(second.url, request_id, None) == whole  # from the start: role chunks too
            numbered = [n for n, (event_id, _) in enumerate(whole) if event_id is not None]
            for after in afters:
                again = resumed(second.url, request_id, after)
                start = next(n for n in numbered if whole[n][0] == str(after + 1))
                assert again == whole[start:]  # every chunk after the reader's, usage and all


def test_a_reader_attached_again_to_the_live_request_gets_the_same_chunks(
    database_url: str, slow_worker: WorkerProcess, unique_prompt: Callable[[str], str]
) -> None:
    prompt = unique_prompt("attach again")
    timeouts = {"stall_s": 60.0}  # a held attempt publishes nothing: not a stall here
    with (
        running_gateway(database_url, [slow_worker], resume_grace_s=GRACE_S, timeouts=timeouts) as gateway,
        held(slow_worker, prompt, at_token=4) as release,
        ThreadPoolExecutor(1) as pool,
    ):
        request_id, first, done = streamed(
            gateway.url, "/v1/chat/completions", chat(prompt, 12, stream_options=ASKED), leave_after=3
        )
        assert not done
        gateway.wait_logged(request_id, lambda events: bool(of(events, ev.ClientDisconnected)))
        later = pool.submit(resumed, gateway.url, request_id, 2)
        gateway.wait_logged(request_id, lambda events: bool(of(events, ev.ClientResumed)))
        release()
        attached = later.result(timeout=60)
        events = gateway.events(request_id)
        assert fold(events).outcome is Outcome.COMPLETED
        whole = resumed(gateway.url, request_id, None)  # the whole stream, from the log
    assert first == whole[: len(first)]
    assert attached == whole[len(first) :]  # from delta 3 on: the same chunks, usage and all
    per_choice, _ = usages(attached)
    assert [u["completion_tokens"] for u in per_choice[0]][:2] == [4, 5]  # counted from the deltas it had
