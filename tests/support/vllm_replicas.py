"""The run's one ``vllm serve`` and one vLLM worker, shared by every test marked ``vllm``.

A vLLM start costs half a minute of both cores here, so each is started once a run, on
first use, by the process that runs the ``vllm`` group (tests/support/scheduling.py):

- ``server``: vLLM's own OpenAI server on the tiny model (a plain replica), with vLLM's
  reasoning and tool-call parsers. Its whole process group must be gone once it is
  stopped; the fixture that owns it checks that.
- ``worker()``: ``phasegate worker --engine vllm`` on the same model and engine
  arguments, faults enabled, started without ``VLLM_CPU_KVCACHE_SPACE`` (the worker sizes
  its KV cache itself: tests/ops/test_worker_cpu_defaults.py reads its log). A test
  that kills it or drains it is marked ``ends_vllm_worker``: those run last in the group
  (tests/conftest.py), and the next one to ask gets a new worker.

The worker starts beside the server, not after it, and the replacements that the tests
which end it will need (``spare_workers``) start one after the other behind it, while the
other tests run: each start would otherwise stand in the group's way, which is the
longest chain of the suite (docs/testing.md).

Both use the engine settings of :data:`WORKER_ARGS` and the parsers of :data:`PARSER_ARGS`:
two running and two queued, so queueing and 429 are cheap to reach, and a three-second
drain.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from tests.support.workers import ManagedProcess, VllmEnv, WorkerProcess, running_vllm_openai_server, start_worker

MODEL = "tiny-llama"
MAX_MODEL_LEN = 4096
DRAIN_GRACE_S = 3.0
ENGINE_ARGS = '{"enforce_eager": true}'  # eager: ready in ~30 s instead of ~60 s of torch.compile here
# vLLM's own parsers, as a deployment that serves tools and reasoning runs them (the tiny
# model has the tokens they look for: ops/models/make_tiny_model.py); the worker takes
# them by the same names (app/worker/vllm_parsing.py)
PARSER_ARGS = ["--reasoning-parser", "deepseek_r1", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
WORKER_ARGS = [
    *("--model", MODEL, "--max-model-len", str(MAX_MODEL_LEN), "--vllm-args", ENGINE_ARGS),
    *("--max-running", "2", "--max-queued", "2", "--grace-s", str(DRAIN_GRACE_S)),
    *PARSER_ARGS,
]
SERVER_ARGS = ["--enforce-eager", *PARSER_ARGS]


@dataclass
class SharedVllm:
    """The shared server and worker (the worker again after a death: one started in the
    background if one is left, else a new one)."""

    env: VllmEnv
    server: ManagedProcess
    server_url: str
    _starting: list[Future[WorkerProcess]] = field(default_factory=list, repr=False)  # oldest first
    _worker: WorkerProcess | None = field(default=None, repr=False)
    worker_starts: int = 0

    def worker(self) -> WorkerProcess:
        """The live worker: the one running, else the next one started in the background, else a new one."""
        if self._worker is not None and not self._worker.alive():
            self._worker.kill()  # reap it and its engine processes
            self._worker = None
        if self._worker is None:
            self._worker = self._starting.pop(0).result() if self._starting else start_vllm_worker(self.env)
            self.worker_starts += 1
        return self._worker

    def close(self) -> None:
        if self._worker is not None:
            self._worker.kill()
        stop_starts(self._starting)


def start_vllm_worker(env: VllmEnv, base_env: Mapping[str, str] | None = None) -> WorkerProcess:
    return start_worker(
        engine="vllm",
        python=env.python,
        model_path=env.model,
        faults=True,
        args=WORKER_ARGS,
        ready_timeout=900.0,  # a spare starts in the background, beside the suite's busiest minutes
        unset_env=["VLLM_CPU_KVCACHE_SPACE"],
        base_env=base_env,
    )


def stop_starts(starting: list[Future[WorkerProcess]]) -> None:
    """Each worker start not taken: not begun, or killed once started."""
    for future in starting:
        if not future.cancel():
            with contextlib.suppress(Exception):  # a start that failed has nothing to stop
                future.result().kill()
    starting.clear()


@contextlib.contextmanager
def shared_vllm(env: VllmEnv, *, spare_workers: int = 0) -> Iterator[SharedVllm]:
    """The server and the worker started together, then ``spare_workers`` more one after
    the other, in the background; on exit all stopped, and the server's whole process
    group (vLLM's engine core among it) checked gone."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-worker-start") as starts:
        # each with this environment, not one that a test running meanwhile changed
        environ = dict(os.environ)
        starting = [starts.submit(start_vllm_worker, env, environ) for _ in range(1 + spare_workers)]
        try:
            with running_vllm_openai_server(
                env,
                served_model_name=MODEL,
                max_model_len=MAX_MODEL_LEN,
                args=SERVER_ARGS,
                extra_env={"VLLM_ENABLE_RESPONSES_API_STORE": "1"},  # its /v1/responses keeps responses (background)
            ) as (process, url):
                shared = SharedVllm(env, process, url, starting)
                try:
                    yield shared
                finally:
                    shared.close()
        finally:
            stop_starts(starting)  # the server's start failed: no worker outlives the run
    deadline = time.monotonic() + 10
    while group_alive(process.pid):
        assert time.monotonic() < deadline, f"vllm serve's process group {process.pid} outlived it"
        time.sleep(0.1)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
