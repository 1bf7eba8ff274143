"""``phasegate serve``: the gateway, with everything it needs when nothing is configured.

With no ``DATABASE_URL`` it starts its embedded PostgreSQL; with no replicas it
starts two simulated workers as child processes. The port is bound first: a second
process on a taken port fails before it touches anything. SIGTERM (or Ctrl-C) drains
(DESIGN.md §11): readiness fails, new requests get 503 ``gateway_draining``, open
streams get up to ``drain_s`` and then their final error; a second signal stops at
once. Then the workers and the database it started stop too: nothing it started is
left running.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import socket
from pathlib import Path
from types import FrameType
from typing import Any

from app.config import ConfigError, GatewayConfig, ReplicaConfig, load_config, parse_replica
from app.contract.worker_token import TOKEN_ENV
from app.supervisor import Child, run_dir, start_worker

log = logging.getLogger("phasegate.serve")

KEEP_ALIVE_S = 75  # seconds an idle client connection is kept open

DEMO_MODEL = "phasegate-sim"
DEMO_REVISION = "sim-1"


def add_serve_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="run the gateway (embedded PostgreSQL and simulated workers by default)")
    p.add_argument("--config", type=Path, help="a TOML file of settings (see docs/configuration.md)")
    p.add_argument("--host", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="listen port (default 8000)")
    p.add_argument(
        "--replica",
        action="append",
        default=[],
        metavar="[KIND=]URL[#ID]",
        help="a replica: worker=http://… (default kind) or openai=http://… (repeatable)",
    )
    p.add_argument("--model", action="append", default=[], metavar="NAME[=REVISION]", help="a served model")
    p.add_argument("--sim-workers", type=int, default=2, help="simulated workers to start when no replica is set")
    p.add_argument(
        "--sim-ms-per-token", type=float, default=None, help="the simulated workers' time per token (default 2)"
    )
    p.add_argument("--log-level", default="info")


def serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per upstream call is noise
    overrides: dict[str, Any] = {"host": args.host, "port": args.port}
    if args.replica:
        overrides["replicas"] = tuple(parse_replica(text, i) for i, text in enumerate(args.replica, start=1))
    if args.model:
        overrides["models"] = dict(_model(text) for text in args.model)
    try:
        config = load_config(args.config, **overrides)
    except ConfigError as exc:
        print(f"phasegate serve: {exc}")
        return 2
    from app.store.database import sqlalchemy_url
    from app.store.embedded import EmbeddedPostgres

    try:
        listener = _bind(config.host, config.port)
    except OSError as exc:
        print(f"phasegate serve: cannot listen on {config.host}:{config.port}: {exc.strerror or exc}")
        return 1
    children: list[Child] = []
    database: EmbeddedPostgres | None = None
    workdir = run_dir()
    # uvicorn stops gracefully on SIGTERM, then raises the signal again with the handler
    # found at start: make that one unwind through the finally below, like Ctrl-C does.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        if not config.replicas:
            config, children = _with_sim_workers(config, args.sim_workers, workdir, args.sim_ms_per_token)
        if config.database_url:
            url = sqlalchemy_url(config.database_url)
        else:
            database = EmbeddedPostgres(config.data_dir)
            url = database.start()
            log.info("embedded PostgreSQL in %s", database.data_dir)
        asyncio.run(_run(config, url, listener))
    finally:
        listener.close()
        for child in children:
            child.stop()
        if database is not None:
            database.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket, before anything else starts (uvicorn's own way of binding)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def _model(text: str) -> tuple[str, str]:
    name, _, revision = text.partition("=")
    return name, revision or "unknown"


def _with_sim_workers(
    config: GatewayConfig, count: int, workdir: Path, ms_per_token: float | None
) -> tuple[GatewayConfig, list[Child]]:
    models = config.models or {DEMO_MODEL: DEMO_REVISION}
    names = [arg for name in models for arg in ("--model", name)]
    if config.worker_token:  # the configured token, not a generated one: the gateway sends that
        os.environ[TOKEN_ENV] = config.worker_token
    if ms_per_token is not None:  # slow enough to watch a stream, kill a gateway and see it swept
        names += ["--sim-decode-ms-per-token", str(ms_per_token)]
    children: list[Child] = []
    for number in range(1, count + 1):
        worker_id = f"sim-{number}"
        children.append(start_worker(worker_id, ["--engine", "sim", "--worker-id", worker_id, *names], run_dir=workdir))
    replicas = tuple(ReplicaConfig(id=child.name, url=child.url) for child in children)
    return load_config(None, **{**_as_dict(config), "replicas": replicas, "models": models}), children


def _as_dict(config: GatewayConfig) -> dict[str, Any]:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


async def _run(config: GatewayConfig, url: str, listener: socket.socket) -> None:
    import uvicorn

    from app.gateway import Gateway

    class DrainingServer(uvicorn.Server):
        """uvicorn, whose first SIGTERM or SIGINT drains the gateway before it stops."""

        draining = False

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            if self.draining:  # a second signal: stop now
                self.should_exit = self.force_exit = True
                return
            self.draining = True
            loop.call_soon_threadsafe(lambda: loop.create_task(self._drain(), name="drain"))

        async def _drain(self) -> None:
            print(f"phasegate drains: open streams get up to {config.drain_s:g}s (a second signal stops now)")
            try:
                await gateway.drain()
            finally:
                self.should_exit = True

    loop = asyncio.get_running_loop()
    gateway = await Gateway.open(config, url)
    server = DrainingServer(
        uvicorn.Config(
            gateway.app,
            host=config.host,
            port=config.port,
            log_level="warning",
            lifespan="on",
            # Longer than clients' idle keep-alive (httpx, the openai SDK: 5 s) and load
            # balancers' (often 60 s), so they close idle connections first: at uvicorn's
            # 5 s default a request sent on a connection being closed got a reset.
            timeout_keep_alive=KEEP_ALIVE_S,
        )
    )
    banner = asyncio.get_running_loop().create_task(_announce(server, config))
    try:
        await server.serve(sockets=[listener])
    finally:
        banner.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await banner


async def _announce(server: Any, config: GatewayConfig) -> None:
    while not server.started:
        await asyncio.sleep(0.05)
    base = f"http://{config.host}:{config.port}"
    model = next(iter(config.models), DEMO_MODEL)
    print(
        f"phasegate is serving {base} ({len(config.replicas)} replica(s): {', '.join(r.id for r in config.replicas)})"
    )
    print("try:")
    print(
        f"  curl -N {base}/v1/chat/completions -H 'content-type: application/json' "
        f'-d \'{{"model": "{model}", "stream": true, "messages": [{{"role": "user", "content": "Hello"}}]}}\''
    )
    print("Ctrl-C drains the gateway, then stops it and everything it started.", flush=True)
