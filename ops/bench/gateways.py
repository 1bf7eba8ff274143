"""The gateways that ``ops/bench/peers.py`` compares: how each is installed and started
in front of the fake upstream, and when it serves."""

from __future__ import annotations

import argparse
import asyncio
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ops.bench.measure import Sample, descendants
from ops.bench.sse_load import ChatClient
from ops.processes import free_port, phasegate, start

MODEL = "m"
HOST = "127.0.0.1"
API_KEY = "sk-" + secrets.token_hex(32)  # what every client sends; LiteLLM wants a strong master key
PEERS = ("relay", "starlette", "starlette-lean", "vllm-router", "phasegate", "litellm")
# what --install puts in each peer's venv; LiteLLM's 1.107.0 release was reported compromised
INSTALL = {"vllm-router": ["vllm-router"], "litellm": ["litellm[proxy]!=1.107.0"]}


@dataclass
class Peer:
    name: str
    port: int
    process: subprocess.Popen[bytes]
    version: str

    def gateway_pids(self) -> list[int]:
        """The processes that serve requests: the children of a supervisor, else itself."""
        return descendants(self.process.pid)[1:] or [self.process.pid]


def venv_of(venvs: Path, name: str) -> Path:
    return venvs / name


def install(venvs: Path, name: str) -> str | None:
    """Create ``name``'s venv and install it; why not, or None."""
    venv = venv_of(venvs, name)
    steps = [[sys.executable, "-m", "venv", str(venv)], [str(venv / "bin/pip"), "install", "-q", *INSTALL[name]]]
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True)
        if done.returncode != 0:
            output = (done.stdout + done.stderr).splitlines()
            lines = [line for line in output if "is ignored: it is neither" not in line]
            return f"{' '.join(step[:3])} failed: {' / '.join(lines[-3:])}"
    return None


def version(venv: Path, package: str) -> str:
    done = subprocess.run(
        [str(venv / "bin/python"), "-c", f"import importlib.metadata as m; print(m.version('{package}'))"],
        capture_output=True,
        text=True,
    )
    return done.stdout.strip() or "?"


def start_peer(name: str, upstream_port: int, workdir: Path, options: argparse.Namespace, database_url: str) -> Peer:
    port = free_port()
    upstream = f"http://{HOST}:{upstream_port}"
    log = workdir / f"{name}.log"
    env: dict[str, str] = {}
    if name == "relay":
        command = [sys.executable, "-m", "ops.bench.relay", "--port", str(port)]
        command += ["--upstream", f"{HOST}:{upstream_port}"]
        release = "asyncio"
    elif name in ("starlette", "starlette-lean"):  # phasegate's stack with nothing of its own
        command = [sys.executable, "-m", "ops.bench.stack_floor", "--port", str(port)]
        command += ["--upstream", f"{HOST}:{upstream_port}"]
        command += ["--lean"] * (name == "starlette-lean")
        release = "floor"
    elif name == "vllm-router":
        venv = venv_of(options.venvs, name)
        command = [str(venv / "bin/vllm-router"), "--host", HOST, "--port", str(port)]
        command += ["--worker-urls", upstream, "--policy", "round_robin", "--log-level", "warning"]
        release = version(venv, "vllm-router")
    elif name == "litellm":
        venv = venv_of(options.venvs, name)
        config = workdir / "litellm.yaml"
        config.write_text(
            "model_list:\n"
            f"  - model_name: {MODEL}\n"
            "    litellm_params:\n"
            f"      model: hosted_vllm/{MODEL}\n"
            f"      api_base: {upstream}/v1\n"
            "      api_key: none\n"
            "litellm_settings:\n  telemetry: false\n"
        )
        command = [str(venv / "bin/litellm"), "--config", str(config), "--host", HOST, "--port", str(port)]
        env = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR", "LITELLM_MASTER_KEY": API_KEY}
        release = version(venv, "litellm")
    else:
        config = workdir / "phasegate.toml"
        config.write_text(
            f'content_policy = "full"\n[models]\n"{MODEL}" = "bench"\n'
            f'[[replicas]]\nid = "fake-vllm"\nurl = "{upstream}"\nkind = "openai"\n'
        )
        command = phasegate("serve", "--config", str(config), "--port", str(port), "--log-level", "warning")
        if options.processes is not None:
            command += ["--processes", str(options.processes)]
        env = {"DATABASE_URL": database_url}
        release = "this tree"
    return Peer(name, port, start(command, env, log), release)


def wait_serving(peer: Peer, timeout_s: float = 120.0) -> None:
    """Until one chat through ``peer`` streams whole."""
    deadline = time.monotonic() + timeout_s

    async def once() -> bool:
        client, sample = ChatClient(HOST, peer.port, MODEL, 4, API_KEY), Sample()
        await client.chat(0, sample, False)
        await client.close()
        return sample.requests == 1

    while time.monotonic() < deadline:
        if peer.process.poll() is not None:
            raise RuntimeError(f"{peer.name} exited with {peer.process.returncode}")
        if asyncio.run(once()):
            return
        time.sleep(0.3)
    raise RuntimeError(f"{peer.name} did not serve within {timeout_s:g}s")
