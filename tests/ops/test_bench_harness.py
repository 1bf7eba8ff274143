"""The parts of ``ops/bench/peers.py`` that its figures rest on, checked with real processes:

- the fake upstream streams what the ``openai`` client reads as a vLLM stream: the role
  first, one content delta a token, ``finish_reason`` on the last, usage when asked;
- the bench's lean client counts the same tokens, directly, through the null relay and
  through the stack's floors (uvicorn and Starlette forwarding, the ordinary way and
  lean), and says why a request failed;
- a process tree's CPU counts its children's, even once they ended, and PostgreSQL's is
  told apart by process (its sessions together).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import asyncpg
import pytest
from openai import OpenAI

from app.store.database import asyncpg_dsn
from app.store.embedded import EmbeddedPostgres
from ops.bench.measure import Sample, cpu_by_kind, cpu_seconds, tree_cpu_seconds
from ops.bench.sse_load import ChatClient
from ops.processes import free_port, start, stop

pytestmark = pytest.mark.slow


def _serving(port: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        time.sleep(0.05)
    raise AssertionError(f"nothing listens on {port}")


@contextlib.contextmanager
def running(module: str, *args: str) -> Iterator[int]:
    port = free_port()
    process = start([sys.executable, "-m", module, "--port", str(port), *args])
    try:
        _serving(port)
        yield port
    finally:
        stop(process)


def test_the_openai_client_reads_the_fake_upstream_as_a_vllm_stream() -> None:
    with running("ops.bench.fake_vllm", "--model", "m") as port:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        chunks = list(
            client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "hi"}],
                stream=True,
                max_tokens=5,
                stream_options={"include_usage": True},
            )
        )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant" and deltas[0].content == ""
    assert [d.content for d in deltas[1:]] == [" tok"] * 5
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    assert len({c.id for c in chunks}) == 1


@pytest.mark.parametrize(
    "gateway", [("ops.bench.relay",), ("ops.bench.stack_floor",), ("ops.bench.stack_floor", "--lean")], ids=str
)
def test_the_lean_client_counts_tokens_directly_and_through_a_floor(gateway: tuple[str, ...]) -> None:
    with running("ops.bench.fake_vllm", "--ttft-ms", "20", "--token-ms", "5") as upstream:
        with running(gateway[0], *gateway[1:], "--upstream", f"127.0.0.1:{upstream}") as relay:
            for port in (upstream, relay):
                sample = Sample()
                client = ChatClient("127.0.0.1", port, "m", 32)

                async def three(client: ChatClient = client, sample: Sample = sample) -> None:
                    for n in range(3):  # on one keep-alive connection
                        await client.chat(n, sample, keep=True)
                    await client.close()

                asyncio.run(three())
                assert (sample.requests, sample.tokens, sample.failures) == (3, 96, 0)
                assert len(sample.ttft) == 3 and len(sample.gaps) == 93
                assert min(sample.ttft) >= 0.02  # the first token is not sent before its time
        refused, client = Sample(), ChatClient("127.0.0.1", free_port(), "m", 4)
        asyncio.run(client.chat(0, refused, keep=True))
        assert refused.why == {"ConnectionRefusedError": 1}


def test_a_process_tree_counts_the_cpu_of_its_children_even_ended_ones() -> None:
    burn = "import time\nend = time.process_time() + 0.4\nwhile time.process_time() < end: pass\n"
    parent_code = (
        "import subprocess, sys, time\n"
        f"subprocess.run([sys.executable, '-c', {burn!r}])\n"  # ended and reaped
        f"child = subprocess.Popen([sys.executable, '-c', {burn!r} + 'time.sleep(30)'])\n"
        "time.sleep(30)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_code], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while tree_cpu_seconds(parent.pid) - cpu_seconds(parent.pid) < 0.75 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert tree_cpu_seconds(parent.pid) - cpu_seconds(parent.pid) >= 0.75  # both children's 0.4 s
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()


async def test_postgresqls_cpu_is_told_apart_by_process_its_sessions_together(
    postgres_server: EmbeddedPostgres | None, database_url: str
) -> None:
    if postgres_server is None:
        pytest.skip("the tests run on a server of their own (PHASEGATE_TEST_DATABASE_URL): no process to read")
    postmaster = int((postgres_server.pgdata / "postmaster.pid").read_text().split("\n", 1)[0])
    session = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        before = cpu_by_kind(postmaster)
        await session.fetchval("SELECT count(*) FROM generate_series(1, 3000000)")  # ~0.3 s of a core
        after = cpu_by_kind(postmaster)
    finally:
        await session.close()
    assert {"client backends", "checkpointer", "walwriter", "postmaster, exited"} <= after.keys()
    assert after["client backends"] - before.get("client backends", 0.0) >= 0.1
    assert all(seconds >= 0 for seconds in after.values())
