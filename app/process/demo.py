"""The embedded default's demo, for ``phasegate serve`` (app/process/serve.py): simulated workers
that join the fleet by themselves, waiting for them, and the banner printed once serving.

The workers join through this gateway with ``--join`` (docs/worker-protocol.md), under
the configured worker token or one generated for the run; the banner says where the
gateway serves, how to try it, the admin token's local URL and how to reach SQL.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.config import GatewayConfig, load_config
from app.contract.worker_token import TOKEN_ENV
from app.http.server import write_ready_file
from app.process.supervisor import Child, start_worker

DEMO_MODEL = "phasegate-sim"
DEMO_REVISION = "sim-rev-1"  # not a worker's name: the demo's workers are sim-1, sim-2…
JOINED = "joined the fleet"  # what a worker's log says once it joined (app/worker/joiner.py)


def wait_joined(children: list[Child], timeout_s: float = 15.0) -> None:
    """Until each of the sim workers says it joined the fleet (its log), a few seconds at
    most, so that the first request finds them (one gateway process waits in itself)."""
    deadline = time.monotonic() + timeout_s
    waiting = list(children)
    while waiting and time.monotonic() < deadline:
        waiting = [child for child in waiting if JOINED not in child.log_path.read_text(errors="replace")]
        time.sleep(0.05)


def with_sim_workers(
    config: GatewayConfig,
    count: int,
    workdir: Path,
    ms_per_token: float | None,
    children: list[Child],
    hold: Callable[[], contextlib.AbstractContextManager[None]],
) -> GatewayConfig:
    """``config`` with ``count`` sim workers started (each in ``children`` as soon as it
    started, so a signal meanwhile still stops every one) that join the fleet by themselves
    through this gateway (``--join``, docs/worker-protocol.md), with the worker token:
    the configured one, else one generated for this run (:func:`app.process.supervisor.worker_token`).
    ``hold`` holds a stop signal while each starts."""
    models = config.models or {DEMO_MODEL: DEMO_REVISION}
    names = [arg for name, revision in models.items() for arg in ("--model", f"{name}={revision}")]
    names += ["--log-format", config.log_format]  # their own log files, in the gateway's format
    if config.worker_token:  # the configured token, not a generated one: the gateway checks that
        os.environ[TOKEN_ENV] = config.worker_token
    if ms_per_token is not None:  # slow enough to watch a stream, kill a gateway and see it swept
        names += ["--sim-decode-ms-per-token", str(ms_per_token)]
    host = "127.0.0.1" if config.host in ("0.0.0.0", "") else "[::1]" if config.host == "::" else config.host
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    names += ["--join", f"http://{host}:{config.port}"]
    for number in range(1, count + 1):
        worker_id = f"sim-{number}"
        with hold():
            children.append(
                start_worker(worker_id, ["--engine", "sim", "--worker-id", worker_id, *names], run_dir=workdir)
            )
    return load_config(None, **{**_as_dict(config), "models": models})  # the worker token: from the environment


def _as_dict(config: GatewayConfig) -> dict[str, Any]:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


def announce(
    config: GatewayConfig, generated_token: str | None, processes: int, ready_file: Path | None, joining: list[str]
) -> None:
    """Once serving: where (in ``ready_file`` too, when given), and how to try it."""
    if ready_file is not None:
        write_ready_file(ready_file, config.host, config.port)
    base = f"http://{config.host}:{config.port}"
    model = next(iter(config.models), DEMO_MODEL)
    if joining:
        replicas = f"{len(joining)} simulated worker(s) joined the fleet: {', '.join(joining)}"
    else:
        listed = ", ".join(r.id for r in config.replicas) or "none"
        replicas = f"{len(config.replicas)} replica(s) configured: {listed}"
    print(f"phasegate is serving {base} ({replicas}; {processes} gateway process(es))")
    print("try:")
    print(
        f"  curl -N {base}/v1/chat/completions -H 'content-type: application/json' "
        f'-d \'{{"model": "{model}", "stream": true, "messages": [{{"role": "user", "content": "Hello"}}]}}\''
    )
    if generated_token is not None:  # the data directory's (or this run's): printed once, here
        print(f"requests and their timelines: {base}/ui/requests?token={generated_token}")
    elif config.admin_token:
        print(f"requests and their timelines: {base}/ui/requests (with the configured admin token)")
    print("SQL over the request log: phasegate sql (--query N, --list, --tenant T: docs/audit.md)")
    print("Ctrl-C drains the gateway, then stops it and everything it started.", flush=True)
