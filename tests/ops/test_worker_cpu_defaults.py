"""`phasegate worker --engine vllm` on a CPU machine starts with a KV cache sized to it.

vLLM on CPU reserves 90% of the machine's memory unless told otherwise, and refuses to
start when less is free. The worker sizes the cache itself unless the user did: the pure
parts are checked here directly, and one real worker is started on the tiny model with
``VLLM_CPU_KVCACHE_SPACE`` unset (marked ``vllm``).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.worker.vllm_engine import (
    MIB,
    MIN_CPU_KV_CACHE_BYTES,
    available_memory_bytes,
    cpu_kv_cache_bytes,
    kv_bytes_per_token,
    with_cpu_kv_cache,
)
from tests.support.workers import REPO, ManagedProcess, vllm_env

GIB = 1 << 30


def test_a_full_batch_within_a_quarter_of_memory() -> None:
    assert cpu_kv_cache_bytes(16 * GIB, batch_needs=2 * GIB) == 2 * GIB
    assert cpu_kv_cache_bytes(16 * GIB, batch_needs=10 * GIB) == 4 * GIB
    assert cpu_kv_cache_bytes(16 * GIB, batch_needs=None) == 4 * GIB
    assert cpu_kv_cache_bytes(16 * GIB, batch_needs=1 * MIB) == MIN_CPU_KV_CACHE_BYTES


def test_bytes_per_token_from_the_models_config(tmp_path: Path) -> None:
    config = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}
    (tmp_path / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    # Llama-3-8B: keys and values, 32 layers, 8 KV heads of 128, two bytes each
    assert kv_bytes_per_token(str(tmp_path), "auto") == 2 * 32 * 8 * 128 * 2 == 128 * 1024
    assert kv_bytes_per_token(str(tmp_path), "float32") == 256 * 1024
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Mystery"]}))
    assert kv_bytes_per_token(str(tmp_path), "auto") is None
    assert kv_bytes_per_token(str(tmp_path / "missing"), "auto") is None


def engine_args(**more: Any) -> dict[str, Any]:
    tiny = Path(__file__).parent / "no-such-model"
    return {"model": str(tiny), "max_model_len": 512, "max_num_seqs": 8, "dtype": "bfloat16", **more}


def test_the_worker_sizes_the_cache_when_nobody_did() -> None:
    sized = with_cpu_kv_cache(engine_args(), {}, available=8 * GIB)
    assert sized["kv_cache_memory_bytes"] == 2 * GIB  # model shape unknown: a quarter
    assert with_cpu_kv_cache(engine_args(), {"VLLM_CPU_KVCACHE_SPACE": ""}, 8 * GIB)["kv_cache_memory_bytes"]


@pytest.mark.parametrize(
    ("environ", "args"),
    [
        ({"VLLM_CPU_KVCACHE_SPACE": "3"}, {}),
        ({}, {"kv_cache_memory_bytes": 123 * MIB}),
        ({}, {"gpu_memory_utilization": 0.5}),
    ],
    ids=["env", "kv_cache_memory_bytes", "gpu_memory_utilization"],
)
def test_the_users_setting_wins(environ: dict[str, str], args: dict[str, Any]) -> None:
    assert with_cpu_kv_cache(engine_args(**args), environ, available=8 * GIB) == engine_args(**args)


def test_available_memory_is_this_machines() -> None:
    total = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0]) * 1024
    assert 0 < available_memory_bytes() <= total


@pytest.mark.vllm
def test_a_vllm_worker_starts_without_vllm_cpu_kvcache_space() -> None:
    env = vllm_env()
    environ = {key: value for key, value in os.environ.items() if key != "VLLM_CPU_KVCACHE_SPACE"}
    tmp = tempfile.TemporaryDirectory(prefix="phasegate-cpu-worker-")
    ready_file, log_path = Path(tmp.name) / "ready.json", Path(tmp.name) / "worker.log"
    cmd = [env.python, "-m", "app.cli", "worker", "--engine", "vllm", "--model-path", env.model]
    cmd += ["--port", "0", "--ready-file", str(ready_file), "--log-level", "info"]
    cmd += ["--vllm-args", '{"enforce_eager": true}']
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=environ,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    worker = ManagedProcess(proc, log_path, tmp)
    try:
        deadline = time.monotonic() + 240
        with httpx.Client(timeout=30) as http:
            while True:
                assert worker.alive(), f"the worker exited:\n{worker.logs()[-4000:]}"
                assert time.monotonic() < deadline, f"not ready in time:\n{worker.logs()[-4000:]}"
                if ready_file.exists():
                    base = f"http://127.0.0.1:{json.loads(ready_file.read_text())['port']}"
                    with contextlib.suppress(httpx.HTTPError):
                        if http.get(f"{base}/v1/ready").status_code == 200:
                            break
                time.sleep(0.2)
        # started: the engine is loaded with its KV cache (generating is the other vllm tests' part)
        logs = worker.logs()
        assert "CPU KV cache:" in logs  # the worker's choice …
        assert "Explicitly set" in logs and "for KV cache" in logs  # … is the size vLLM used
    finally:
        worker.kill()
