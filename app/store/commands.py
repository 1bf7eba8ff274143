"""``phasegate db …``: migrate the event log's database and check its read models.

Without ``DATABASE_URL`` these run against the embedded server, starting it if no
other phasegate process holds it (and stopping it again when done).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from sqlalchemy.ext.asyncio import create_async_engine

from app.store import migrate
from app.store.audit import fold_disagreements
from app.store.database import database_from_env


def add_db_parser(subparsers: Any) -> None:
    """Register ``db`` and its subcommands on the CLI's subparsers."""
    db = subparsers.add_parser("db", help="the event log's database: migrate it, check it")
    commands = db.add_subparsers(dest="db_command", required=True)
    upgrade = commands.add_parser("upgrade", help="apply the schema's migrations")
    upgrade.add_argument("revision", nargs="?", default="head", help="target revision (default: head)")
    downgrade = commands.add_parser("downgrade", help="undo migrations; 'base' drops the whole log")
    downgrade.add_argument("revision", help="target revision, e.g. base")
    commands.add_parser("current", help="print the schema's revision")
    commands.add_parser("check", help="compare the read models with the fold of every request's events")
    db.set_defaults(run=run_db_command)


def run_db_command(args: argparse.Namespace) -> int:
    url, server = database_from_env()
    if server is not None:
        server.stop_on_signals()
    try:
        if args.db_command == "upgrade":
            migrate.upgrade(url, args.revision)
            print(f"schema at revision {migrate.current_revision(url)}")
        elif args.db_command == "downgrade":
            migrate.downgrade(url, args.revision)
            print(f"schema at revision {migrate.current_revision(url) or 'base (empty)'}")
        elif args.db_command == "current":
            print(migrate.current_revision(url) or "base (empty)")
        else:
            return asyncio.run(_check(url))
        return 0
    finally:
        if server is not None:
            server.stop()


async def _check(url: str) -> int:
    engine = create_async_engine(url)
    try:
        async with engine.connect() as connection:
            found = await fold_disagreements(connection)
    finally:
        await engine.dispose()
    for disagreement in found:
        print(disagreement, file=sys.stderr)
    print(f"{len(found)} disagreements between the read models and the log")
    return 1 if found else 0
