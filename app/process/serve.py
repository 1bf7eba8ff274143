"""``phasegate serve``: the gateway, with everything it needs when nothing is configured.

With no ``DATABASE_URL`` it starts its embedded PostgreSQL; with no replicas it
starts two simulated workers (``--sim-workers N``) as child processes, which join the
fleet by themselves under a worker token generated for the run, as any worker started
with ``--join`` does (docs/worker-protocol.md); ``--sim-workers 0`` starts a gateway with
an empty fleet: ready, answering 503 ``no_replica_available`` until a replica joins. The port is bound first: a second
process on a taken port fails before it touches anything. SIGTERM (or Ctrl-C) drains
(docs/design.md §11): readiness fails, new requests get 503 ``gateway_draining``, open
streams get up to ``drain_s`` and then their final error; a second signal ends them
with that error now (a third stops at once). Then the workers and the database it
started stop too: nothing it started is left running. A signal before the server runs
(while PostgreSQL or the workers start) stops the same way, without a traceback.

``--processes N`` (default: the container's CPU quota, else the cores; 1 for the demo)
runs N gateway processes on the one port bound here (:class:`GatewayProcesses`): each an
instance of its own, the stop signals forwarded to every one. With 1 the gateway runs in
this process (:func:`run_gateway`).

``SIGHUP`` (``phasegate reload``) reads the configuration again: applied at once in every
gateway process, or refused with the reason in the log while the running one serves on
(app/process/reload.py). Its pid is in ``--pid-file``, else in its embedded PostgreSQL's data
directory, for ``phasegate reload`` to find.

With no ``admin_token`` configured and a loopback listen address (the demo's case), it
generates one and prints, once, a local URL that carries it, as Jupyter does: the
requests page opens from there (the page swaps the token for a cookie). A configured
token is never printed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import logging
import secrets
import shutil
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.config import LOG_FORMATS, ConfigError, GatewayConfig, load_config, parse_replica
from app.process import demo
from app.process.gateway_process import ChildSpec, frame, quiet_libraries, run_gateway
from app.process.gateway_process import bind_listening as _bind
from app.process.gateway_process import is_loopback as _is_loopback
from app.process.reload import ReloadRefused, Settings, pid_file_of, remove_pid_file, write_pid_file
from app.process.start_signals import Deferred, exit_on_signal, quiet_swallowed_stop, uninterrupted
from app.process.supervisor import Child, ChildFailed, GatewayProcesses, default_processes, run_dir
from app.telemetry import logs

log = logging.getLogger("phasegate.serve")


def add_serve_parser(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="run the gateway (embedded PostgreSQL and simulated workers by default)",
        description="Run the gateway. With nothing configured: its own PostgreSQL (embedded), two simulated "
        "workers and one gateway process on http://127.0.0.1:8000. Ctrl-C drains, a second Ctrl-C ends open "
        "streams now. Settings: defaults, then --config (TOML: docs/configuration.md), then the environment, "
        "then these flags.",
        epilog="environment: DATABASE_URL names the log's PostgreSQL (else the embedded server); "
        "PHASEGATE_DATA_DIR is the embedded server's home (default /var/lib/phasegate as root, else "
        "~/.local/share/phasegate); PHASEGATE_WORKER_TOKEN the workers' shared token. The admin token (the "
        "request list, /v1/requests): admin_token in the TOML file; with none, on 127.0.0.1 the embedded "
        "default keeps one in the data directory (phasegate admin-token prints it, --rotate replaces it), "
        "and it is printed in the request list's URL at every start. SQL over the log: phasegate sql.",
    )
    p.add_argument("--config", type=Path, help="a TOML file of settings (see docs/configuration.md)")
    p.add_argument("--host", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="listen port (default 8000; 0 picks a free one, see --ready-file)")
    p.add_argument("--ready-file", type=Path, help="write {host, port, pid} here once serving (default: none)")
    p.add_argument(
        "--pid-file", type=Path, help="write its pid here, for `phasegate reload` (default: in the embedded data dir)"
    )
    p.add_argument(
        "--replica",
        action="append",
        default=[],
        metavar="[KIND=]URL[#ID]",
        help="a replica: worker=http://… (default kind) or openai=http://… (repeatable)",
    )
    p.add_argument(
        "--model", action="append", default=[], metavar="NAME[=REVISION]", help="a served model (repeatable)"
    )
    p.add_argument(
        "--sim-workers", type=int, default=2, help="simulated workers to start when no replica is set (default 2)"
    )
    p.add_argument(
        "--sim-ms-per-token",
        type=float,
        default=None,
        help="the simulated workers' time per token in ms (default 2; 50 is slow enough to watch a resume or a drain)",
    )
    p.add_argument(
        "--processes",
        type=_positive,
        help="gateway processes sharing the port (default: the container's CPU quota, else the cores; 1 for the demo)",
    )
    p.add_argument(
        "--log-level",
        default="info",
        metavar="{debug,info,warning,error}",
        help="the lowest level logged, on stderr (default info; debug adds alembic's migration lines)",
    )
    p.add_argument(
        "--log-format", choices=LOG_FORMATS, help="text (default) or json: one object a line, with request_id"
    )


def serve(args: argparse.Namespace) -> int:
    configured = _configure(args)
    if isinstance(configured, int):
        return configured  # a bad setting, said
    settings, config = configured
    from app.store.database import sqlalchemy_url
    from app.store.embedded import EmbeddedPostgres, EmbeddedPostgresError
    from app.store.reach import DatabaseUnreachable, wait_for_database

    try:
        listener = _bind(config.host, config.port)
    except OSError as exc:
        print(f"phasegate serve: cannot listen on {config.host}:{config.port}: {exc.strerror or exc}")
        return 1
    if config.port == 0:  # the port picked: the instance's address and the announcement name it
        config = dataclasses.replace(config, port=listener.getsockname()[1])
    # the demo's simulated workers share the cores with it, and one process is plenty to try it
    processes = args.processes or (default_processes() if config.replicas else 1)
    code = 0
    children: list[Child] = []
    database: EmbeddedPostgres | None = None
    workdir = run_dir()
    pid_file = pid_file_of(config, args.pid_file)
    config, generated_token = _with_admin_token(config)
    try:
        if pid_file is not None:
            write_pid_file(pid_file)
        if not config.replicas and not config.discover:
            config = demo.with_sim_workers(
                config, args.sim_workers, workdir, args.sim_ms_per_token, children, uninterrupted
            )
            logs.redact(config.worker_token)  # generated for the sim workers
        if config.database_url:
            url = sqlalchemy_url(config.database_url)
        else:
            database = EmbeddedPostgres(config.data_dir)
            try:
                with uninterrupted():
                    url = database.start()
            except EmbeddedPostgresError as exc:  # its message says what to change: no traceback
                print(f"phasegate serve: {exc}")
                return 1
            log.info("embedded PostgreSQL in %s", database.data_dir)
        joining = [child.name for child in children]
        announce = functools.partial(demo.announce, config, generated_token, processes, args.ready_file, joining)
        settings.running = config
        try:  # once, before any gateway process opens it: it may be starting too
            asyncio.run(wait_for_database(url, config.database_wait_s))
        except DatabaseUnreachable as exc:  # waited for, in vain: which database and why, no traceback
            print(f"phasegate serve: {exc}")
            return 1
        if processes == 1:
            follow = functools.partial(_follow_hangups, settings)
            stop_asked = lambda: Deferred.received  # noqa: E731
            asyncio.run(
                run_gateway(config, url, [listener], announce, stop_asked=stop_asked, on_open=follow, joining=joining)
            )
            if Deferred.received is not None:  # asked to stop while it started: as if the start was cut
                code = 128 + Deferred.received
        else:
            code = _serve_processes(settings, url, listener, announce, processes, args.log_level, workdir, children)
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # the cleanup below runs to its end
            signal.signal(signum, signal.SIG_IGN)
        if pid_file is not None:
            remove_pid_file(pid_file)
        listener.close()
        for child in children:
            child.stop()
        if database is not None:
            database.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return code


def _configure(args: argparse.Namespace) -> tuple[Settings, GatewayConfig] | int:
    """The signals set for the start, the configuration loaded, the logs and traces set
    up; an exit code where a setting is wrong."""
    # Until the server runs (and after it stopped), SIGTERM and Ctrl-C unwind through the
    # finally of serve() as SystemExit: no KeyboardInterrupt traceback, nothing left running.
    # While it runs, DrainingServer handles them.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, exit_on_signal)
    sys.unraisablehook = quiet_swallowed_stop  # such a stop swallowed where it landed: no traceback
    signal.signal(signal.SIGHUP, Deferred.hangup)  # a reload asked while it starts: once it serves
    overrides: dict[str, Any] = {"host": args.host, "port": args.port, "log_format": args.log_format}
    if args.replica:
        overrides["replicas"] = tuple(parse_replica(text, i) for i, text in enumerate(args.replica, start=1))
    if args.model:
        overrides["models"] = dict(_model(text) for text in args.model)
    try:
        config = load_config(args.config, **overrides)
    except ConfigError as exc:
        print(f"phasegate serve: {exc}")
        return 2
    settings = Settings(args.config, overrides, config)
    logs.configure(args.log_level, config.log_format)
    quiet_libraries()
    logs.redact(*_secrets(config))
    if config.otel_endpoint:
        from app.telemetry import tracing

        try:
            tracing.configure(config.otel_endpoint, config.otel_service_name)
        except tracing.TracingUnavailable as exc:
            print(f"phasegate serve: {exc}")
            return 2
    return settings, config


def _with_admin_token(config: GatewayConfig) -> tuple[GatewayConfig, str | None]:
    """Where no admin token is set and the gateway listens on loopback, one generated (the
    embedded default's kept in its data directory, so its URL lasts across starts)."""
    if config.admin_token is not None or not _is_loopback(config.host):
        return config, None
    from app.store.admin_token import stable_admin_token

    embedded = not config.database_url
    generated = stable_admin_token(config.data_dir) if embedded else secrets.token_urlsafe(24)
    return dataclasses.replace(config, admin_token=generated), generated


def _reread(settings: Settings) -> GatewayConfig | None:
    """The configuration read again and checked whole, or None (refused, and logged so)."""
    try:
        config = settings.reread()
    except ReloadRefused as refused:
        settings.refused(refused)
        return None
    logs.redact(*_secrets(config))
    return config


def _follow_hangups(settings: Settings, gateway: Any) -> None:
    """One gateway process: each SIGHUP reloads it, in its loop (one asked meanwhile: now)."""

    def reload() -> None:
        config = _reread(settings)
        if config is not None:
            gateway.reload(config)
            settings.applied(config)

    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGHUP, reload)
    if Deferred.hangups:
        loop.call_soon(reload)


def _secrets(config: GatewayConfig) -> list[str | None]:
    """What no log line may hold: keys, tokens, the DSN's password (the printed demo URL is
    not a log line)."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    password = None
    if config.database_url:
        with contextlib.suppress(ArgumentError, ValueError):
            password = make_url(config.database_url).password
    return [*config.api_keys, config.admin_token, config.worker_token, config.metrics_token, password]


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def _serve_processes(
    settings: Settings,
    url: str,
    listener: socket.socket,
    announce: Callable[[], None],
    count: int,
    level: str,
    workdir: Path,
    joining: list[Child],
) -> int:
    """``count`` gateway processes on ``listener`` (:class:`GatewayProcesses`), until a stop
    signal, forwarded to each, drained them all. The log's schema is migrated here, once.
    A SIGHUP reads the configuration again and sends it to every process (:func:`_reread`)."""
    config = settings.running
    if config.apply_migrations:
        from app.store.migrate import upgrade

        with uninterrupted():
            upgrade(url)

    def spec(config: GatewayConfig) -> bytes:
        return frame(ChildSpec(config, url, level, tuple(secret for secret in _secrets(config) if secret)))

    def reload() -> None:
        config = _reread(settings)
        if config is not None:
            gateways.send(spec(config))
            settings.applied(config)

    gateways = GatewayProcesses(count, listener, spec(config), workdir)
    gateways.on_hangup = reload
    signal.signal(signal.SIGHUP, lambda received, frame: gateways.hangup())
    if Deferred.hangups:
        gateways.hangup()
    try:
        try:
            gateways.start()
        except ChildFailed as exc:
            print(f"phasegate serve: {exc}")
            return 1
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda received, frame: gateways.forward(received))
        if Deferred.received is not None:  # asked to stop while they started (see Deferred)
            gateways.forward(Deferred.received)
            gateways.run()
            return 128 + Deferred.received
        demo.wait_joined(joining)
        announce()
        return gateways.run()
    finally:
        gateways.kill()


def _model(text: str) -> tuple[str, str]:
    name, _, revision = text.partition("=")
    return name, revision or "unknown"
