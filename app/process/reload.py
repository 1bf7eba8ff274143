"""Reading the configuration again without a restart (docs/design.md §16), and ``phasegate reload``.

``SIGHUP`` to ``phasegate serve`` (``phasegate reload`` sends it) has the parent read its
settings again as it read them at start (the ``--config`` file, the environment, the
flags: :class:`Settings`), and check them whole. A file that does not load, or that
changes a setting only a restart can change, is refused: the reason goes to the log and
the running configuration serves on. Otherwise the new configuration goes to every
gateway process of the instance at once (app/process/serve.py, app/process/gateway_process.py), which
apply it between two requests (app/process/gateway.py, ``Gateway.reload``).

What a reload changes (:data:`RELOADABLE`): the replicas (``[[replicas]]`` and
``[[discover]]``), the models and their revisions, routing, API keys, the request limits
and the tenants' limits, and the timeouts, which apply to requests accepted after it (a
request keeps those it was accepted with: live streams never notice). Everything else
(the port, the database, the tokens, the policy, ...) needs a restart and is named in
the refusal; so are ``timeouts.connect_s`` and ``timeouts.upstream_response_s``, which
the replicas' clients hold.

``serve`` writes its pid to ``--pid-file``, else (the embedded PostgreSQL's case) to
``phasegate.pid`` in its data directory; ``phasegate reload`` reads either.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import signal
from pathlib import Path
from typing import Any

from app.config import ConfigError, GatewayConfig, load_config

log = logging.getLogger("phasegate.reload")

RELOADABLE = frozenset(
    {"replicas", "discover", "models", "routing", "api_keys", "api_key_cache_s", "limits", "tenant_limits", "timeouts"}
)
CLIENT_TIMEOUTS = ("connect_s", "upstream_response_s")  # held by the replicas' clients: a restart
PID_FILE = "phasegate.pid"


class ReloadRefused(Exception):
    """The settings read again cannot be applied; the message says why."""


def needs_restart(running: GatewayConfig, new: GatewayConfig) -> list[str]:
    """The settings that differ between ``running`` and ``new`` and that only a restart changes."""
    names = [
        f.name
        for f in dataclasses.fields(GatewayConfig)
        if f.name not in RELOADABLE and getattr(running, f.name) != getattr(new, f.name)
    ]
    names += [
        f"timeouts.{name}" for name in CLIENT_TIMEOUTS if getattr(running.timeouts, name) != getattr(new.timeouts, name)
    ]
    return names


def changed(running: GatewayConfig, new: GatewayConfig) -> list[str]:
    """The reloadable settings that differ (for the log line of a reload applied)."""
    return sorted(name for name in RELOADABLE if getattr(running, name) != getattr(new, name))


class Settings:
    """The settings as ``serve`` read them at start, to read again: ``path`` and the flags'
    ``overrides``; ``started`` is what they gave then, ``running`` what the instance serves
    (what ``serve`` made of them: the port it picked, a generated admin token, the demo's
    simulated workers and model)."""

    def __init__(self, path: Path | None, overrides: dict[str, Any], started: GatewayConfig) -> None:
        self.path, self.overrides, self.started = path, overrides, started
        self.running = started

    def reread(self) -> GatewayConfig:
        """The configuration to serve from now on, checked whole; raises :class:`ReloadRefused`."""
        try:
            new = load_config(self.path, **self.overrides)
        except ConfigError as exc:
            raise ReloadRefused(str(exc)) from None
        # a setting only a restart changes, changed: unlike at start, and unlike what serve
        # made of it (the worker token it generated for the demo's workers is in the
        # environment now, which the file is read with)
        running = set(needs_restart(self.running, new))
        restart = [name for name in needs_restart(self.started, new) if name in running]
        if restart:
            raise ReloadRefused(f"{', '.join(restart)} cannot change without a restart")
        # what only a restart changes is as it runs: the port picked, the tokens generated
        kept = {
            f.name: getattr(self.running, f.name) for f in dataclasses.fields(GatewayConfig) if f.name not in RELOADABLE
        }
        kept["timeouts"] = dataclasses.replace(
            new.timeouts, **{name: getattr(self.running.timeouts, name) for name in CLIENT_TIMEOUTS}
        )
        demo = not self.started.replicas and not self.started.discover  # serve started simulated workers
        if demo and not new.replicas and not new.discover:
            kept["replicas"] = self.running.replicas
        if not self.started.models and not new.models:  # the demo's model
            kept["models"] = self.running.models
        try:
            return dataclasses.replace(new, **kept)
        except ConfigError as exc:
            raise ReloadRefused(str(exc)) from None

    def applied(self, config: GatewayConfig) -> None:
        log.warning(
            "configuration reloaded from %s: %s",
            self.path or "the flags",
            ", ".join(changed(self.running, config)) or "nothing changed",
        )
        self.running = config

    def refused(self, reason: ReloadRefused) -> None:
        log.error("configuration reload refused (the running configuration serves on): %s", reason)


# --- the pid file, and ``phasegate reload`` ---------------------------------------------------


def pid_file_of(config: GatewayConfig, pid_file: Path | None) -> Path | None:
    """Where ``serve`` writes its pid: ``--pid-file``, else its embedded PostgreSQL's data
    directory (its own: one server per directory); None with a database elsewhere."""
    if pid_file is not None:
        return pid_file
    if config.database_url:
        return None
    from app.store.data_dir import default_data_dir

    return (config.data_dir or default_data_dir()) / PID_FILE


def write_pid_file(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(f"{os.getpid()}\n")
    temporary.replace(path)


def remove_pid_file(path: Path) -> None:
    """Removed if it still names this process (a later serve may have written its own)."""
    with contextlib.suppress(OSError, ValueError):
        if int(path.read_text().strip()) == os.getpid():
            path.unlink()


def add_reload_parser(sub: Any) -> None:
    p = sub.add_parser("reload", help="have a running `phasegate serve` read its configuration again (SIGHUP)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--data-dir", type=Path, help="the instance's data directory (default: the embedded default)")
    where.add_argument("--pid-file", type=Path, help="the pid file it was started with (--pid-file)")
    where.add_argument("--config", type=Path, help="its settings file: the data directory it names (data_dir)")
    p.set_defaults(run=reload_command)


def reload_command(args: argparse.Namespace) -> int:
    path = args.pid_file
    if path is None and args.config is not None:
        try:
            path = pid_file_of(load_config(args.config), None)
        except ConfigError as exc:
            print(f"phasegate reload: {exc}")
            return 1
        if path is None:
            print("phasegate reload: with a database_url, serve writes its pid only to --pid-file; name that file")
            return 1
    if path is None:
        from app.store.data_dir import default_data_dir

        data_dir = args.data_dir or Path(os.environ.get("PHASEGATE_DATA_DIR") or default_data_dir())
        path = data_dir / PID_FILE
    try:
        pid = int(path.read_text().strip())
    except (OSError, ValueError) as exc:
        print(f"phasegate reload: no running phasegate serve found at {path} ({exc}); see --pid-file")
        return 1
    if not _is_serve(pid):
        print(f"phasegate reload: {path} names pid {pid}, which is not a running phasegate serve")
        return 1
    os.kill(pid, signal.SIGHUP)
    print(f"phasegate reload: asked phasegate serve (pid {pid}) to read its configuration again;")
    print("its log says whether it applied it or refused it, and why")
    return 0


def _is_serve(pid: int) -> bool:
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"serve" in command
