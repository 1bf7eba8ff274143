"""Engines under test: how the protocol suite starts a worker of each engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from tests.support.vllm_replicas import MODEL, SharedVllm
from tests.support.workers import WorkerProcess, start_worker

# Two engine slots and two queue places, so queueing and 429 are cheap to reach (the
# shared vLLM worker has the same: tests/support/vllm_replicas.py).
SLOTS = ["--max-running", "2", "--max-queued", "2"]


@dataclass
class EngineUnderTest:
    """A running worker of one engine, and how to ask it for short or long generations."""

    engine: str
    worker: WorkerProcess
    model: str
    long_tokens: int  # a generation that takes well over a second
    max_prompt_words: int  # a prompt of this many words is too long
    # How late a frame may reach the test, beyond the worker's own timing. On this
    # two-core machine vLLM's engine processes spin (sched_yield) while decoding and
    # other processes can stall for up to a second or so; the sim engine does not.
    jitter_s: float

    def long(self, **params: Any) -> dict[str, Any]:
        return {"max_tokens": self.long_tokens, "ignore_eos": True, "temperature": 0.0, "seed": 7, **params}

    def short(self, tokens: int = 8, **params: Any) -> dict[str, Any]:
        return {"max_tokens": tokens, "ignore_eos": True, "temperature": 0.0, "seed": 7, **params}


def start_sim_engine(args: list[str] | None = None) -> EngineUnderTest:
    worker = start_worker(faults=True, args=[*SLOTS, "--sim-decode-ms-per-token", "5", *(args or [])])
    return EngineUnderTest("sim", worker, "sim", long_tokens=2000, max_prompt_words=40_000, jitter_s=0.25)


def vllm_engine(vllm: SharedVllm) -> EngineUnderTest:
    """The run's shared vLLM worker (the same slots as :data:`SLOTS`, a 4096-token context)."""
    return EngineUnderTest("vllm", vllm.worker(), MODEL, long_tokens=4000, max_prompt_words=5000, jitter_s=2.0)


ENGINES = [pytest.param("sim", id="sim"), pytest.param("vllm", id="vllm", marks=pytest.mark.vllm)]
