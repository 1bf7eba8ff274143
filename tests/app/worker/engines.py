"""Engines under test: how the protocol suite starts a worker of each engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from tests.support.workers import WorkerProcess, start_worker, vllm_env

# Two engine slots and two queue places, so queueing and 429 are cheap to reach.
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


def start_engine(engine_name: str, args: list[str] | None = None) -> EngineUnderTest:
    if engine_name == "sim":
        worker = start_worker(faults=True, args=[*SLOTS, "--sim-decode-ms-per-token", "5", *(args or [])])
        return EngineUnderTest("sim", worker, "sim", long_tokens=2000, max_prompt_words=40_000, jitter_s=0.25)
    env = vllm_env()
    worker = start_worker(
        engine="vllm",
        python=env.python,
        model_path=env.model,
        faults=True,
        # eager: ready in ~30 s instead of ~60 s of torch.compile on two cores
        args=[
            *SLOTS,
            *("--model", "tiny-llama", "--max-model-len", "4096", "--vllm-args", '{"enforce_eager": true}'),
            *(args or []),
        ],
        ready_timeout=300,
    )
    return EngineUnderTest("vllm", worker, "tiny-llama", long_tokens=4000, max_prompt_words=5000, jitter_s=2.0)


ENGINES = [pytest.param("sim", id="sim"), pytest.param("vllm", id="vllm", marks=pytest.mark.vllm)]
