"""The ``phasegate`` command line.

    phasegate serve     the gateway (embedded PostgreSQL and simulated workers by default)
    phasegate worker    a replica: one engine behind the lease protocol
    phasegate db        the log's schema: upgrade, downgrade, current, check, maintain
    phasegate replay    re-run requests' recorded decisions, from the log or a trace file
    phasegate trace     export requests as a trace file, import one elsewhere
    phasegate keys      API keys, stored hashed: create (printed once), list, revoke
    phasegate tenants   a tenant's data: erase its content, keep the events

Each subcommand's module is imported only when it runs, so ``phasegate worker`` does
not load the gateway and ``phasegate serve`` does not load vLLM.
"""

from __future__ import annotations

import argparse
import sys

from app.incident.commands import add_incident_parsers
from app.serve import add_serve_parser
from app.store.commands import add_db_parser
from app.store.tenant_commands import add_tenant_parsers
from app.worker.config import add_worker_parser


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="phasegate", description="An OpenAI-compatible gateway that never splices.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(sub)
    add_worker_parser(sub)
    add_db_parser(sub)
    add_incident_parsers(sub)
    add_tenant_parsers(sub)
    args = parser.parse_args(argv)
    if args.command == "serve":
        from app.serve import serve

        return serve(args)
    if args.command == "worker":
        from app.worker.server import main as worker_main

        return worker_main(args)
    return int(args.run(args))  # db, replay, trace, keys, tenants


if __name__ == "__main__":
    sys.exit(main())
