"""The sim engine, the lease table and the parsers, in process (no sockets)."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys

import pytest

from app.contract.worker_protocol import RENEWAL_SLACK
from app.worker.attempt import Attempt, AttemptTable
from app.worker.engine import EngineOutput
from app.worker.faults import FaultBook
from app.worker.lease_calls import AttemptRef
from app.worker.protocol import AttemptSpec, Code, Refusal, Sampling
from app.worker.sim import SimEngine, SimTiming, tool_call_id
from app.worker.start_request import parse_sampling
from tests.support.workers import REPO

FAST = SimTiming(0.0, 0.0, 0.0)


def spec(request_id: str = "r", prompt: str = "hello", *, attempt: int = 1, epoch: int = 1, **sampling) -> AttemptSpec:
    return AttemptSpec(request_id, attempt, epoch, 5.0, "sim", None, prompt, Sampling(**sampling), 0.25)


async def run(engine: SimEngine, s: AttemptSpec, rid: str = "e") -> list[EngineOutput]:
    return [output async for output in engine.generate(rid, await engine.prepare(s))]


async def test_the_sim_is_a_function_of_the_request():
    engine = SimEngine(timing=FAST)
    one = await run(engine, spec("a", max_tokens=20, seed=3))
    two = await run(engine, spec("b", max_tokens=20, seed=3))  # another request id, same content
    other = await run(engine, spec("c", max_tokens=20, seed=4))
    assert [o.token_ids for o in one] == [o.token_ids for o in two] != [o.token_ids for o in other]
    assert one[-1].finish_reason in ("stop", "length") and all(o.finish_reason is None for o in one[:-1])


async def test_the_sim_honours_max_tokens_stop_and_n():
    engine = SimEngine(timing=FAST)
    out = await run(engine, spec(max_tokens=7, ignore_eos=True, n=3))
    assert sorted({o.choice for o in out}) == [0, 1, 2] and len(out) == 21
    assert [o.finish_reason for o in out if o.finish_reason] == ["length"] * 3
    full = "".join(o.text for o in await run(engine, spec(max_tokens=30, ignore_eos=True)))
    stop = full.split()[5]
    cut = await run(engine, spec(max_tokens=30, ignore_eos=True, stop=(stop,)))
    assert cut[-1].finish_reason == "stop" and stop not in "".join(o.text for o in cut)


async def test_an_answer_that_reaches_max_tokens_ends_by_length():
    """As vLLM's: where the sim's natural answer is exactly max_tokens long, its end of
    sequence would be one token more, so max_tokens cut it (a background response asked for
    16 tokens is ``incomplete`` whatever its prompt)."""
    engine = SimEngine(timing=FAST)
    for n in range(400):  # a prompt whose natural answer is 16 tokens: about one in 113
        natural = await run(engine, spec(prompt=f"p{n}", max_tokens=200))
        if len(natural) == 16:
            break
    else:
        pytest.fail("no prompt of 400 has a 16-token natural answer")
    assert natural[-1].finish_reason == "stop"
    capped = await run(engine, spec(prompt=f"p{n}", max_tokens=16))
    assert [o.token_ids for o in capped] == [o.token_ids for o in natural]
    assert capped[-1].finish_reason == "length"


async def test_sim_tool_calls_have_ids_of_the_request():
    engine = SimEngine(timing=FAST)
    tools = (
        {
            "type": "function",
            "function": {"name": "f", "parameters": {"properties": {"n": {"type": "integer"}}}},
        },
    )
    out = await run(engine, spec("req_9", tools=tools))
    (call,) = [o.tool_call for o in out if o.tool_call]
    assert call.tool_call_id == tool_call_id("req_9", 0, 0) and call.name == "f" and '"n":' in call.arguments
    assert out[-1].finish_reason == "tool_calls"


async def test_the_sim_honours_vllms_extras():
    engine = SimEngine(timing=FAST)
    texts = set()
    for _ in range(3):  # min_tokens holds the end off; top_k and the like change the (seeded) words
        out = await run(engine, spec(max_tokens=200, min_tokens=150, seed=1, top_k=5))
        assert sum(len(o.token_ids) for o in out) >= 150
        texts.add("".join(o.text for o in out))
    plain = "".join(o.text for o in await run(engine, spec(max_tokens=200, min_tokens=150, seed=1)))
    assert len(texts) == 1 and plain not in texts
    for n in range(4):
        chosen = await run(engine, spec(seed=n, structured_outputs={"choice": ["yes", "no"]}))
        assert [(o.text, o.finish_reason) for o in chosen] in ([("yes", "stop")], [("no", "stop")])
    json_text = "".join(o.text for o in await run(engine, spec(structured_outputs={"json_object": True})))
    assert json_text.startswith('{"text": "') and json_text.endswith('"}')


async def test_sim_logprobs_are_a_function_of_each_token():
    engine = SimEngine(timing=SimTiming(0.0, 0.0, 0.0, tokens_per_delta=3))
    out = await run(engine, spec(max_tokens=9, ignore_eos=True, seed=2, logprobs=2))
    again = await run(engine, spec(max_tokens=9, ignore_eos=True, seed=2, logprobs=2))
    assert [o.logprobs for o in out] == [o.logprobs for o in again]
    for output in out:  # batched outputs carry one entry per token
        assert output.logprobs is not None and len(output.logprobs) == len(output.token_ids)
        assert "".join(entry[0] for entry in output.logprobs) == output.text
        for token, logprob, top in output.logprobs:
            assert logprob <= 0 and len(top) == 2 and top[0] == [token, logprob] and top[1][1] < logprob
    plain = await run(engine, spec(max_tokens=9, ignore_eos=True, seed=2))
    assert all(o.logprobs is None for o in plain)
    assert [o.text for o in plain] == [o.text for o in out]  # asking for them changes no word


async def test_a_sim_abort_waits_for_the_request_to_stop():
    engine = SimEngine(timing=SimTiming(0.0, 0.001, 0.05))
    outputs = engine.generate("x", await engine.prepare(spec(max_tokens=10_000, ignore_eos=True)))
    await anext(outputs)
    generated = await engine.abort("x")
    assert generated is not None and generated > 1
    assert await engine.abort("x") is None  # already gone


async def test_the_lease_table_fences():
    table = AttemptTable(retain_s=60)
    first = spec("r", epoch=5)
    attempt = Attempt(first, None, None, now=0.0)  # type: ignore[arg-type]
    table.add(attempt, 0.0)
    with pytest.raises(Refusal) as refused:
        table.check_start(first, 1.0)
    assert refused.value.code is Code.DUPLICATE_ATTEMPT
    with pytest.raises(Refusal) as refused:
        table.check_start(spec("r", attempt=2, epoch=4), 1.0)
    assert refused.value.code is Code.STALE_LEASE_EPOCH
    assert table.check_start(spec("r", attempt=2, epoch=6), 1.0) == [attempt]  # to revoke
    with pytest.raises(Refusal) as refused:
        table.find(AttemptRef("r", 1, 4, None))
    assert refused.value.code is Code.STALE_LEASE_EPOCH
    table.tombstone(AttemptRef("q", 1, 1, None), 1.0)
    with pytest.raises(Refusal) as refused:
        table.check_start(spec("q"), 2.0)
    assert refused.value.code is Code.ATTEMPT_CANCELLED
    table.prune(1000.0)
    assert table.check_start(spec("q"), 1000.0) == []  # tombstones are forgotten after retain_s


async def test_a_renewal_extends_a_lease_no_further_than_the_slack_past_the_last_answered():
    """The worker's side of a lease the gateway can prove lapsed (app/replicas/renewer.py):
    a renewal read at ``now`` extends to ``now + ttl``, but no further than ``RENEWAL_SLACK``
    TTLs past the TTL of the last renewal answered (as read here), and never back."""
    ttl = 10.0
    cap = ttl * (1 + RENEWAL_SLACK)  # past the last answered renewal's read
    attempt = Attempt(dataclasses.replace(spec("r"), lease_ttl_s=ttl), None, None, now=0.0)  # type: ignore[arg-type]

    def renew(renewal: int | None, answered: int | None, now: float) -> float:
        attempt.expires_at = attempt.renewed_until(AttemptRef("r", 1, 1, ttl, renewal, answered), now)
        return attempt.expires_at

    assert renew(1, 0, 3.0) == 3.0 + ttl  # answers coming: a TTL from the read
    assert renew(2, 0, 9.0) == min(9.0 + ttl, cap)  # 1's answer lost: capped past the start's read
    assert renew(3, 0, 0.5 * ttl + cap) == cap  # read long after: capped all the same
    assert renew(4, 0, 0.6 * ttl + cap) == cap  # and it never moves back
    read_4 = 0.6 * ttl + cap
    assert renew(5, 4, read_4 + 1.0) == read_4 + 1.0 + ttl  # 4's answer came: from 4's read
    assert renew(6, 2, read_4 + 2.0) == read_4 + 1.0 + ttl  # 2, older than 4 the gateway named: no further
    assert renew(None, None, read_4 + 3.0) == read_4 + 3.0 + ttl  # a renewal by hand: as asked


def test_sampling_and_fault_parsing_name_the_bad_field():
    with pytest.raises(Refusal) as refused:
        parse_sampling({"top_p": 0})
    assert refused.value.field == "params.top_p"
    assert parse_sampling({"stop": "x"}).stop == ("x",)
    extras = {"top_k": 3, "min_p": 0.1, "repetition_penalty": 1.2, "min_tokens": 4}
    parsed = parse_sampling({"max_tokens": 8, **extras, "structured_outputs": {"regex": "[a-z]+"}})
    assert (parsed.top_k, parsed.min_p, parsed.repetition_penalty, parsed.min_tokens) == (3, 0.1, 1.2, 4)
    assert parsed.structured_outputs == {"regex": "[a-z]+"} and parsed.logprobs is None
    assert parse_sampling({"logprobs": True, "top_logprobs": 4}).logprobs == 4  # chat's form
    assert parse_sampling({"logprobs": 0}).logprobs == 0  # the completions' form
    for bad, field in (
        ({"min_tokens": 9, "max_tokens": 8}, "params.min_tokens"),
        ({"top_k": -3}, "params.top_k"),
        ({"structured_outputs": {"regex": "("}}, "params.structured_outputs.regex"),
        (
            {"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}},
            "params.structured_outputs",
        ),
        ({"guided_regex": "a"}, "params.guided_regex"),  # the gateway sends vLLM's current name only
        ({"logprobs": True, "top_logprobs": 21}, "params.top_logprobs"),
        ({"logprobs": 6}, "params.logprobs"),
    ):
        with pytest.raises(Refusal) as refused:
            parse_sampling(bad)
        assert refused.value.field == field and refused.value.status == 400
    book = FaultBook()
    fault = book.add({"action": "stall", "at_token": 2, "match": {"prompt_contains": "zz"}, "times": 2})
    assert book.take(spec(prompt="no")) is None
    assert book.take(spec(prompt="a zz b")) is fault and fault.remaining == 1


def test_only_the_vllm_engine_imports_vllm():
    """The vLLM engine, its request handling, parsing, beam search, pooling and utility routes (imported by it
    alone) are the only modules that import vLLM, and a worker on the sim engine never loads it."""
    offenders = []
    for path in sorted((REPO / "app").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            if any(n == "vllm" or n.startswith("vllm.") for n in names):
                offenders.append(path.relative_to(REPO).as_posix())
    assert set(offenders) == {
        "app/worker/vllm_beams.py",
        "app/worker/vllm_engine.py",
        "app/worker/vllm_parsing.py",
        "app/worker/vllm_pooling.py",
        "app/worker/vllm_requests.py",
        "app/worker/vllm_utility.py",
    }
    code = "import sys, app.cli, app.worker.server, app.replicas.worker_client; print('vllm' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_the_prompt_text_that_matchers_and_the_sim_see():
    assert spec(prompt="x").prompt_text() == "x"
    chat = AttemptSpec("r", 1, 1, 5.0, "sim", ({"role": "user", "content": "hi"},), None, Sampling(), 0.25)
    assert chat.prompt_text() == "user: hi"
