"""The ``phasegate`` command line.

    phasegate serve     the gateway (embedded PostgreSQL and simulated workers by default)
    phasegate reload    have a running gateway read its configuration again (SIGHUP)
    phasegate worker    a replica: one engine behind the lease protocol
    phasegate db        the log's schema: upgrade, downgrade, current, check, maintain
    phasegate replay    re-run requests' recorded decisions, from the log or a trace file
    phasegate trace     export requests as a trace file, import one elsewhere
    phasegate keys      API keys, stored hashed: create (printed once), list, revoke
    phasegate tenants   a tenant's data: erase its content, keep the events
    phasegate sql       psql on the log (the configured database; --tenant, --query N)
    phasegate admin-token  the embedded default's admin token (--rotate replaces it)
    phasegate replicas  the fleet through a gateway's admin API: list, add, cordon, uncordon, remove

Only the module of the subcommand named is imported (its parser with it), so
``phasegate worker`` does not load the gateway or SQLAlchemy and starts in a third of
the time, and ``phasegate serve`` does not load vLLM. Without a known subcommand (``-h``,
a typo) every parser is built, for the help and the error.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from typing import Any

# subcommand -> (module, the function there that adds its parser or parsers)
PARSERS: dict[str, tuple[str, str]] = {
    "serve": ("app.process.serve", "add_serve_parser"),
    "reload": ("app.process.reload", "add_reload_parser"),
    "worker": ("app.worker.config", "add_worker_parser"),
    "db": ("app.store.commands", "add_db_parser"),
    "replay": ("app.incident.commands", "add_incident_parsers"),
    "trace": ("app.incident.commands", "add_incident_parsers"),
    "keys": ("app.store.tenant_commands", "add_tenant_parsers"),
    "tenants": ("app.store.tenant_commands", "add_tenant_parsers"),
    "sql": ("app.store.sql_command", "add_sql_parser"),
    "admin-token": ("app.store.admin_token", "add_admin_token_parser"),
    "replicas": ("app.process.fleet_cli", "add_replicas_parser"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="phasegate", description="An OpenAI-compatible gateway that never splices.")
    sub = parser.add_subparsers(dest="command", required=True)
    named = [PARSERS[argv[0]]] if argv and argv[0] in PARSERS else PARSERS.values()
    for adder in dict.fromkeys(named):  # each module's adder once
        _adder(adder)(sub)
    args = parser.parse_args(argv)
    if args.command == "serve":
        from app.process.serve import serve

        return serve(args)
    if args.command == "worker":
        from app.worker.server import main as worker_main

        return worker_main(args)
    return int(args.run(args))  # reload, db, replay, trace, keys, tenants, sql, admin-token, replicas


def _adder(where: tuple[str, str]) -> Callable[[Any], None]:
    module, name = where
    return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


if __name__ == "__main__":
    sys.exit(main())
