"""``phasegate db …``: migrate the event log's database, check its read models, and
maintain its day partitions (:mod:`app.store.partitions`).

Without ``DATABASE_URL`` these run against the embedded server, starting it if no
other phasegate process holds it (and stopping it again when done).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

import asyncpg
from sqlalchemy.ext.asyncio import create_async_engine

from app.store import migrate, partitions
from app.store.audit import fold_disagreements
from app.store.database import asyncpg_dsn, database_from_env


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
    maintain = commands.add_parser(
        "maintain", help="make the log's day partitions ahead; archive and drop those past retention"
    )
    maintain.add_argument("--days-ahead", type=int, default=3, help="partitions made ahead of today (default 3)")
    maintain.add_argument(
        "--retention-days", type=int, default=None, help="drop days older than this (default: keep everything)"
    )
    maintain.add_argument("--archive-dir", type=Path, default=None, help="write each day as a trace here first")
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
        elif args.db_command == "maintain":
            if args.retention_days is not None and args.retention_days < 1:
                print("--retention-days must be at least 1", file=sys.stderr)
                return 2
            print(asyncio.run(_maintain(url, args)))
        else:
            return asyncio.run(_check(url))
        return 0
    finally:
        if server is not None:
            server.stop()


async def _maintain(url: str, args: argparse.Namespace) -> partitions.Maintenance:
    connection = await asyncpg.connect(asyncpg_dsn(url))
    try:
        return await partitions.maintain(
            connection,
            days_ahead=args.days_ahead,
            retention_days=args.retention_days,
            archive_dir=args.archive_dir,
            wait=True,
        )
    finally:
        await connection.close()


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
