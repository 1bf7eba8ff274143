"""OpenAI-compatible replicas (the kind ``vllm serve`` is): every upstream HTTP behaviour.

The upstreams here are scripted servers in their own processes (vLLM cannot be told
to misbehave); the vLLM server itself is exercised in the vllm-marked tests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import re
import sys
from collections.abc import AsyncGenerator, Iterator

import openai
import pytest

from app.config import ReplicaConfig, Timeouts
from app.replicas.base import ProbeAnswer
from app.replicas.openai_stream import parse_chunk
from app.replicas.openai_upstream import OpenAIUpstream
from statemachine import events as ev
from statemachine.events import FailureKind, ReleaseReason
from statemachine.replay import replay
from statemachine.request_state import Outcome
from statemachine.state import fold
from tests.support.gateway import MODEL, RunningGateway, running_gateway
from tests.support.scripted_upstream import ScriptedUpstream, answer, running_scripted_upstream
from tests.support.transcript import of

TIMEOUTS = Timeouts(
    stall_s=2.0,
    lease_ttl_s=0.6,
    cancel_ack_s=0.5,
    first_token_soft_s=1.0,
    first_token_hard_s=3.0,
    upstream_response_s=1.0,
)
PROMPT = "the same prompt"
# for a test of how tokens are written, not of when a replica is given up: a loaded CI
# machine's first token can outlast the tight deadlines above (the answer was then an error)
PATIENT = dataclasses.replace(
    TIMEOUTS, stall_s=10.0, first_token_soft_s=10.0, first_token_hard_s=20.0, upstream_response_s=10.0
)


@pytest.fixture(scope="module")
def upstreams() -> Iterator[list[ScriptedUpstream]]:
    with running_scripted_upstream() as first, running_scripted_upstream() as second:
        yield [first, second]


@pytest.fixture
def gateway(database_url: str, upstreams: list[ScriptedUpstream]) -> Iterator[RunningGateway]:
    for upstream in upstreams:
        upstream.script()  # nothing queued from an earlier test
    replicas = [ReplicaConfig(id=f"u{n}", url=u.base_url, kind="openai") for n, u in enumerate(upstreams, start=1)]
    with running_gateway(database_url, replicas, timeouts=TIMEOUTS) as running:
        yield running


def chat(gateway: RunningGateway, *, stream: bool = True, max_tokens: int = 6) -> tuple[str, str]:
    client = gateway.openai()
    messages = [{"role": "user", "content": PROMPT}]
    if stream:
        chunks = client.chat.completions.create(model=MODEL, messages=messages, stream=True, max_tokens=max_tokens)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return chunks.response.headers["x-request-id"], text
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=max_tokens)
    return raw.headers["x-request-id"], raw.parse().choices[0].message.content or ""


def script_first(upstreams: list[ScriptedUpstream], behaviour: dict[str, object]) -> None:
    """The next request's first attempt misbehaves, whichever upstream it lands on."""
    for upstream in upstreams:
        upstream.script({**behaviour, "attempt": 1})


EXPECTED = "".join(answer(PROMPT, 6))


def test_an_attempts_frames_are_closed_with_it_not_left_to_the_collector(gateway: RunningGateway) -> None:
    """An async generator dropped unfinished is closed by asyncio's finalizer hook: a
    wake-up of the loop from itself (a write to its self-pipe) and a task, per request."""
    left: list[str] = []

    async def watch_the_collector() -> None:  # on the gateway's loop: its thread's hooks
        hooks = sys.get_asyncgen_hooks()

        def finalizer(generator: AsyncGenerator[object, None]) -> None:
            left.append(generator.__qualname__)
            assert hooks.finalizer is not None
            hooks.finalizer(generator)

        sys.set_asyncgen_hooks(firstiter=hooks.firstiter, finalizer=finalizer)

    gateway.call(watch_the_collector())
    for stream in (True, False):
        assert chat(gateway, stream=stream)[1] == EXPECTED
    gateway.settle()
    gc.collect()
    assert left == []


@pytest.mark.parametrize("stream", [True, False])
def test_an_openai_upstream_serves_streamed_and_whole_answers(gateway: RunningGateway, stream: bool) -> None:
    request_id, text = chat(gateway, stream=stream)
    assert text == EXPECTED
    assert fold(gateway.events(request_id)).outcome is Outcome.COMPLETED


@pytest.mark.parametrize("batch", [16, 2])
def test_the_tokens_of_one_read_go_out_in_one_write_and_to_the_log_in_batches(
    database_url: str, upstreams: list[ScriptedUpstream], batch: int
) -> None:
    """Tokens that arrive in one read are written to a client that is caught up in one
    write (one HTTP chunk), except where a delivery batch closes among them: no write
    carries more deltas than a batch holds, and the log records each batch as sent."""
    upstream = upstreams[0]
    upstream.script({"burst": 5})  # tokens 0-4 in one write, 5-9 in the next, ...
    replicas = [ReplicaConfig(id="u1", url=upstream.base_url, kind="openai")]
    overrides = {"timeouts": PATIENT, "delivery_batch_tokens": batch, "delivery_batch_ms": 60_000.0}
    with running_gateway(database_url, replicas, **overrides) as gateway, gateway.http() as http:
        body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "stream": True, "max_tokens": 20}
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            request_id = response.headers["x-request-id"]
            pieces = list(response.iter_raw())  # one a chunk at most: a chunk is one write
        events = gateway.events(request_id)
    writes = [[int(n) for n in re.findall(rb'id: (\d+)\ndata: [^\n]*"content"', piece)] for piece in pieces]
    writes = [ids for ids in writes if ids]
    assert [n for ids in writes for n in ids] == list(range(20)), (pieces, [type(e).__name__ for e in events])
    if batch == 16:  # each read's deltas in one write (with more, where the client was behind)
        for burst in ({5, 6, 7, 8, 9}, {10, 11, 12, 13, 14}):
            assert any(burst <= set(ids) for ids in writes), writes
    assert max(map(len, writes)) <= batch
    delivered = [e for e in events if isinstance(e, ev.DeltasDelivered)]
    assert [(e.from_index, e.to_index) for e in delivered] == [(n, min(n + batch, 20)) for n in range(0, 20, batch)]
    assert "".join(e.text or "" for e in delivered) == "".join(answer(PROMPT, 20))
    assert fold(events).outcome is Outcome.COMPLETED


def test_429_honours_retry_after_and_never_hammers(gateway: RunningGateway, upstreams: list[ScriptedUpstream]) -> None:
    script_first(upstreams, {"status": 429, "retry_after": 30})
    before = [u.requests for u in upstreams]
    request_id, text = chat(gateway)
    for upstream in upstreams:
        upstream.script()  # drop the 429 the other upstream did not get to use
    assert text == EXPECTED
    events = gateway.events(request_id)
    refused, served = (s.replica_id for s in of(events, ev.AttemptStarted))  # type: ignore[attr-defined]
    (failed,) = of(events, ev.UpstreamFailed)
    assert failed.kind is FailureKind.REJECTED and failed.upstream_status == 429  # type: ignore[attr-defined]
    for _ in range(3):
        later_id, _ = chat(gateway)
        assert of(gateway.events(later_id), ev.AttemptStarted)[0].replica_id == served  # type: ignore[attr-defined]
    index = int(refused[1:]) - 1
    assert upstreams[index].requests - before[index] == 1  # asked once, then left alone


@pytest.mark.parametrize("stream", [True, False])
def test_a_4xx_is_passed_on_naming_the_clients_param_and_not_retried(
    gateway: RunningGateway, upstreams: list[ScriptedUpstream], stream: bool
) -> None:
    refusal = {"status": 400, "code": "context_length_exceeded", "message": "prompt is too long", "param": "messages"}
    script_first(upstreams, refusal)
    with pytest.raises(openai.BadRequestError) as caught:
        chat(gateway, stream=stream)
    assert caught.value.code == "context_length_exceeded" and caught.value.param == "messages"
    assert "prompt is too long" in caught.value.message
    assert caught.value.response.headers["x-should-retry"] == "false"
    events = gateway.events(caught.value.response.headers["x-request-id"])
    assert len(of(events, ev.AttemptStarted)) == 1
    (failed,) = of(events, ev.UpstreamFailed)  # the log says what the client was told
    assert failed.upstream_param == "messages" and failed.upstream_code == "context_length_exceeded"  # type: ignore[attr-defined]


@pytest.mark.parametrize("stream", [True, False])
def test_a_refusal_inside_the_stream_is_the_clients_400_and_ejects_nothing(
    gateway: RunningGateway, upstreams: list[ScriptedUpstream], stream: bool
) -> None:
    """vLLM streams what its engine refuses once the stream began (``thinking_token_budget``
    without a reasoning configuration) as an error object with a 400 ``code``: the client
    gets that 400 with vLLM's words, the attempt is not retried, and the replica is not
    counted at fault (docs/design.md §13). An error object of a 5xx code stays the replica's."""
    message = "thinking_token_budget is set but reasoning_config is not configured."
    for upstream in upstreams:  # wherever the attempt lands
        upstream.script(
            {"error_in_stream": {"message": message, "type": "BadRequestError", "param": None, "code": 400}}
        )
    asked = sum(upstream.requests for upstream in upstreams)
    with pytest.raises(openai.BadRequestError) as caught:
        chat(gateway, stream=stream)
    assert caught.value.code == "upstream_bad_request" and message in caught.value.message
    assert caught.value.response.headers["x-should-retry"] == "false"
    events = gateway.events(caught.value.response.headers["x-request-id"])
    (failed,) = of(events, ev.UpstreamFailed)
    assert failed.kind is FailureKind.REQUEST_REFUSED and failed.upstream_status == 400  # type: ignore[attr-defined]
    assert sum(upstream.requests for upstream in upstreams) - asked == 1
    for upstream in upstreams:
        upstream.script()  # drop the one the other upstream did not get to use
    pool = gateway.gateway.ctx.pool
    assert [replica.consecutive_failures for replica in pool.replicas.values()] == [0, 0]
    assert all(replica.ejected_until == 0 for replica in pool.replicas.values())


def test_an_error_of_the_replicas_own_inside_the_stream_is_retried(
    gateway: RunningGateway, upstreams: list[ScriptedUpstream]
) -> None:
    script_first(upstreams, {"error_in_stream": {"message": "the engine died", "code": 500}})
    request_id, text = chat(gateway)
    assert text == EXPECTED
    (failed,) = of(gateway.events(request_id), ev.UpstreamFailed)
    assert failed.kind is FailureKind.REPLICA_EXITED  # type: ignore[attr-defined]


@pytest.mark.parametrize("stream", [True, False])
def test_a_chat_echo_is_sent_by_the_gateway_before_the_answer(
    gateway: RunningGateway, upstreams: list[ScriptedUpstream], stream: bool
) -> None:
    """vLLM's streamed chat echo fails, so the replica is asked without ``echo`` and the
    gateway sends the continued message before the answer, as vLLM's whole answer has it
    (app/replicas/chat_echo.py); a whole answer, which carries the prompt's log probabilities
    an echo asks for, is asked unstreamed with the echo, as vLLM's whole echo works; the log
    holds what the client got."""
    messages = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": "Once"}]
    asked = {"add_generation_prompt": False, "continue_final_message": True, "echo": True}
    client = gateway.openai()
    if stream:
        chunks = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=6,
            stream=True,
            extra_body=asked,  # type: ignore[arg-type]
        )
        request_id = chunks.response.headers["x-request-id"]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=messages,
            max_tokens=6,
            extra_body=asked,  # type: ignore[arg-type]
        )
        request_id, text = raw.headers["x-request-id"], raw.parse().choices[0].message.content or ""
    assert text == "Once" + "".join(answer(PROMPT + "\nOnce", 6))
    sent = [upstream.last_body for upstream in upstreams]
    asked_upstream = next(body for body in sent if body is not None and body["messages"] == messages)
    assert (asked_upstream.get("echo"), asked_upstream["stream"]) == ((None, True) if stream else (True, False))
    events = gateway.events(request_id)
    assert "".join(e.text or "" for e in of(events, ev.DeltasDelivered)) == text  # type: ignore[attr-defined]
    after_a_user = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=6, extra_body={"echo": True}
    )
    assert after_a_user.choices[0].message.content == EXPECTED  # nothing to echo


def test_a_5xx_is_retried_within_the_budget(gateway: RunningGateway, upstreams: list[ScriptedUpstream]) -> None:
    script_first(upstreams, {"status": 500})
    request_id, text = chat(gateway)
    assert text == EXPECTED
    assert len(of(gateway.events(request_id), ev.AttemptStarted)) == 2


def test_a_500_from_every_upstream_is_poison_and_ejects_neither(
    gateway: RunningGateway, upstreams: list[ScriptedUpstream]
) -> None:
    for upstream in upstreams:  # each attempt, wherever it lands, gets a 500
        upstream.script({"status": 500, "message": "the engine crashed on this request"})
    asked = sum(upstream.requests for upstream in upstreams)
    with pytest.raises(openai.APIStatusError) as caught:
        gateway.openai(max_retries=2).chat.completions.create(  # the SDK's default retries: refused by the header
            model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=6
        )
    assert caught.value.status_code == 502 and caught.value.code == "poison_request"
    assert caught.value.response.headers["x-should-retry"] == "false"
    events = gateway.events(caught.value.response.headers["x-request-id"])
    assert [f.upstream_status for f in of(events, ev.UpstreamFailed)] == [500, 500]  # type: ignore[attr-defined]
    assert sum(upstream.requests for upstream in upstreams) - asked == 2  # one attempt each, no client retry
    pool = gateway.gateway.ctx.pool
    assert [replica.consecutive_failures for replica in pool.replicas.values()] == [0, 0]


@pytest.mark.parametrize(
    ("behaviour", "kind"),
    [
        ({"malformed_at": 0}, FailureKind.LIVENESS_UNCERTAIN),
        ({"malformed_at": 0, "malformed": "lone_surrogate"}, FailureKind.LIVENESS_UNCERTAIN),
        ({"hang": True}, FailureKind.LIVENESS_UNCERTAIN),
    ],
    ids=["malformed chunk", "text that is not unicode", "never answers"],
)
def test_uncertain_upstreams_are_fenced_by_closing_the_connection_then_retried(
    gateway: RunningGateway, upstreams: list[ScriptedUpstream], behaviour: dict[str, object], kind: FailureKind
) -> None:
    script_first(upstreams, behaviour)
    request_id, text = chat(gateway)
    assert text == EXPECTED
    events = gateway.events(request_id)
    (failed,) = of(events, ev.UpstreamFailed)
    assert failed.kind is kind  # type: ignore[attr-defined]
    order = [type(e).__name__ for e in events]
    second = [i for i, e in enumerate(events) if isinstance(e, ev.AttemptStarted)][1]
    # nothing was delivered: closing the connection is the fence (vLLM aborts on it, no
    # acknowledgement exists for this kind), so no lease is waited out (docs/design.md §7)
    assert "CancelAcked" not in order and "LeaseExpired" not in order
    assert order.index("AttemptFenced") < order.index("AttemptReleased") < second
    (fenced,) = of(events, ev.AttemptFenced)
    assert fenced.waiting_for == "connection_close"  # type: ignore[attr-defined]
    (released,) = of(events, ev.AttemptReleased)
    assert released.because is ReleaseReason.CONNECTION_CLOSED  # type: ignore[attr-defined]
    assert replay(events).ok


def test_an_unknown_finish_reason_is_a_malformed_stream_and_never_reaches_the_log(
    gateway: RunningGateway, upstreams: list[ScriptedUpstream]
) -> None:
    script_first(upstreams, {"finish_reason": "eos"})  # no word OpenAI or vLLM uses: the fold would refuse it
    request_id, text = chat(gateway, stream=False)  # a whole answer: nothing was delivered, so it is retried
    assert text == EXPECTED
    events = gateway.events(request_id)
    (failed,) = of(events, ev.UpstreamFailed)
    assert failed.kind is FailureKind.LIVENESS_UNCERTAIN and "unknown finish reason 'eos'" in failed.detail  # type: ignore[attr-defined]
    (completed,) = of(events, ev.RequestCompleted)
    assert completed.finish_reason == "length" and replay(events).ok  # type: ignore[attr-defined]


@pytest.mark.parametrize("no_done", ["hold", "close"])
def test_a_stream_without_done_completes_once_every_choice_finished(
    gateway: RunningGateway, upstreams: list[ScriptedUpstream], no_done: str
) -> None:
    script_first(upstreams, {"no_done": no_done})
    request_id, text = chat(gateway)
    assert text == EXPECTED
    events = gateway.events(request_id)
    assert not of(events, ev.UpstreamFailed)  # no stall timer had to end it
    assert fold(events).outcome is Outcome.COMPLETED


def test_a_connection_cut_before_output_is_retried(gateway: RunningGateway, upstreams: list[ScriptedUpstream]) -> None:
    script_first(upstreams, {"cut_at": 0})
    request_id, text = chat(gateway)
    assert text == EXPECTED
    (failed,) = of(gateway.events(request_id), ev.UpstreamFailed)
    assert failed.kind is FailureKind.REPLICA_EXITED  # type: ignore[attr-defined]


def test_a_connection_cut_after_output_ends_the_stream(
    gateway: RunningGateway, upstreams: list[ScriptedUpstream]
) -> None:
    script_first(upstreams, {"cut_at": 3})
    with pytest.raises(openai.APIError) as caught:
        chat(gateway)
    assert caught.value.code == "upstream_decode_interrupted"
    assert isinstance(caught.value.body, dict) and caught.value.body["delivered_output_tokens"] == 3


def test_text_that_is_not_unicode_after_output_ends_the_stream_with_a_structured_error(
    gateway: RunningGateway, upstreams: list[ScriptedUpstream]
) -> None:
    script_first(upstreams, {"malformed_at": 3, "malformed": "lone_surrogate"})
    client = gateway.openai()
    messages = [{"role": "user", "content": PROMPT}]
    chunks = client.chat.completions.create(model=MODEL, messages=messages, stream=True, max_tokens=6)
    received = []
    with pytest.raises(openai.APIError) as caught:
        for chunk in chunks:
            received.extend(c.delta.content or "" for c in chunk.choices)
    assert "".join(received) == "".join(answer(PROMPT, 6)[:3])  # what came before it, nothing spliced
    assert caught.value.code == "upstream_decode_interrupted"
    events = gateway.events(chunks.response.headers["x-request-id"])
    (failed,) = of(events, ev.UpstreamFailed)
    assert failed.kind is FailureKind.LIVENESS_UNCERTAIN and "surrogate" in failed.detail  # type: ignore[attr-defined]
    assert fold(events).outcome is Outcome.FAILED
    assert replay(events).ok


def test_escaped_surrogate_pairs_are_text() -> None:
    chunk = parse_chunk('{"choices": [{"index": 0, "delta": {"content": "\\ud83d\\ude00 ok"}}]}')
    assert chunk["choices"][0]["delta"]["content"] == "\N{GRINNING FACE} ok"  # an emoji as ASCII-only JSON writes it


def test_text_holding_u0000_reaches_the_client_and_the_log_records_it_replaced(
    gateway: RunningGateway, upstreams: list[ScriptedUpstream]
) -> None:
    script_first(upstreams, {"nul_at": 1})
    request_id, text = chat(gateway)
    words = answer(PROMPT, 6)
    assert text == "".join([words[0], words[1] + "\x00", *words[2:]])  # what the model sent
    events = gateway.events(request_id)
    assert fold(events).outcome is Outcome.COMPLETED
    recorded = "".join(event.text for event in of(events, ev.DeltasDelivered))  # type: ignore[attr-defined]
    assert recorded == text.replace("\x00", "\N{REPLACEMENT CHARACTER}")


async def test_a_probe_says_whether_the_upstream_answered_or_stayed_silent() -> None:
    """Silent (a listener that never answers) is told apart from unhealthy (nothing listens)."""

    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.read(1 << 16):  # read the probe, answer nothing, until the client gives up
            pass
        writer.close()

    server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    silent = OpenAIUpstream("s", f"http://127.0.0.1:{port}", health_model=MODEL, response_timeout_s=0.3)
    async with server:
        assert await silent.health() is ProbeAnswer.SILENT
        await silent.close()
    # a refusal is answered at once: a long deadline cannot make it silent, as a loaded machine's 0.3 s did
    nobody = OpenAIUpstream("n", f"http://127.0.0.1:{port}", health_model=MODEL, response_timeout_s=10.0)
    assert await nobody.health() is ProbeAnswer.UNHEALTHY  # connection refused
    await nobody.close()
