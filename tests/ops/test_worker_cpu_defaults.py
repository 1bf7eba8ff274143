"""`phasegate worker --engine vllm` on a CPU machine starts with a KV cache sized to it.

vLLM on CPU reserves 90% of the machine's memory unless told otherwise, and refuses to
start when less is free. The worker sizes the cache itself unless the user did: the pure
parts are checked here directly, and one real worker is started on the tiny model with
``VLLM_CPU_KVCACHE_SPACE`` unset (marked ``vllm``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from app.worker.vllm_memory import (
    MIB,
    MIN_CPU_KV_CACHE_BYTES,
    available_memory_bytes,
    cpu_kv_cache_bytes,
    kv_bytes_per_token,
    with_cpu_kv_cache,
)
from tests.support.vllm_replicas import SharedVllm

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
def test_a_vllm_worker_starts_without_vllm_cpu_kvcache_space(vllm: SharedVllm) -> None:
    """The run's shared vLLM worker is started with ``VLLM_CPU_KVCACHE_SPACE`` unset
    (tests/support/vllm_replicas.py): it chose the cache size, and vLLM used it."""
    worker = vllm.worker()
    assert "VLLM_CPU_KVCACHE_SPACE" not in proc_environ(worker.pid)
    logs = worker.logs()
    assert "CPU KV cache:" in logs  # the worker's choice …
    assert "Explicitly set" in logs and "for KV cache" in logs  # … is the size vLLM used


def proc_environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(entry.split("=", 1) for entry in raw.decode(errors="replace").split("\0") if "=" in entry)
