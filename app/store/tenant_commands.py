"""``phasegate keys …`` and ``phasegate tenants …``: API keys, and a tenant's content.

    phasegate keys create --tenant T     a new key, printed once (only its SHA-256 is kept)
    phasegate keys list [--tenant T]     id, tenant, fingerprint, created, revoked
    phasegate keys revoke ID             the key stops working within the gateways' key cache
    phasegate tenants erase T            a tenant's recorded content goes; the events stay

Like ``phasegate db``, these use ``DATABASE_URL`` or the embedded server, and need the
schema at revision 0006 or later (``phasegate db upgrade``).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from sqlalchemy.exc import ProgrammingError
from sqlalchemy.ext.asyncio import create_async_engine

from app.store import keys
from app.store.content import erase_tenant
from app.store.database import database_from_env


def add_tenant_parsers(subparsers: Any) -> None:
    """Register ``keys`` and ``tenants`` on the CLI's subparsers."""
    keys_parser = subparsers.add_parser("keys", help="API keys stored hashed in the log's database")
    commands = keys_parser.add_subparsers(dest="keys_command", required=True)
    create = commands.add_parser("create", help="create a key for a tenant; the key is printed once")
    create.add_argument("--tenant", required=True, help="the tenant whose requests the key makes")
    listing = commands.add_parser("list", help="list keys (never the keys themselves)")
    listing.add_argument("--tenant", help="only this tenant's keys")
    revoke = commands.add_parser("revoke", help="revoke a key by its id")
    revoke.add_argument("key_id", metavar="ID")
    keys_parser.set_defaults(run=run_keys_command)

    tenants = subparsers.add_parser("tenants", help="a tenant's data in the log")
    tenant_commands = tenants.add_subparsers(dest="tenants_command", required=True)
    erase = tenant_commands.add_parser(
        "erase", help="remove a tenant's content (delivered text, inputs, tool data); keep the events"
    )
    erase.add_argument("tenant")
    tenants.set_defaults(run=run_tenants_command)


def run_keys_command(args: argparse.Namespace) -> int:
    if args.keys_command in ("create", "list") and args.tenant is not None and not _valid_tenant(args.tenant):
        print("a tenant is 1 to 200 printable characters", file=sys.stderr)
        return 2
    if args.keys_command == "create":
        return _with_database(lambda connection: _create(connection, args.tenant))
    if args.keys_command == "list":
        return _with_database(lambda connection: _list(connection, args.tenant))
    return _with_database(lambda connection: _revoke(connection, args.key_id))


def run_tenants_command(args: argparse.Namespace) -> int:
    if not _valid_tenant(args.tenant):
        print("a tenant is 1 to 200 printable characters", file=sys.stderr)
        return 2
    return _with_database(lambda connection: _erase(connection, args.tenant))


def _valid_tenant(tenant: str) -> bool:
    return 0 < len(tenant) <= 200 and tenant.isprintable()


async def _create(connection: Any, tenant: str) -> int:
    stored, key = await keys.create_key(connection, tenant)
    print(f"created key {stored.id} for tenant {tenant} ({stored.fingerprint}); it is shown only now:", file=sys.stderr)
    print(key)
    return 0


async def _list(connection: Any, tenant: str | None) -> int:
    for stored in await keys.list_keys(connection, tenant):
        revoked = stored.revoked_at.isoformat() if stored.revoked_at else "-"
        print(f"{stored.id}\t{stored.tenant}\t{stored.fingerprint}\t{stored.created_at.isoformat()}\t{revoked}")
    return 0


async def _revoke(connection: Any, key_id: str) -> int:
    if not await keys.revoke_key(connection, key_id):
        print(f"no unrevoked key {key_id}", file=sys.stderr)
        return 1
    print(f"revoked {key_id}; gateways refuse it once their key cache expires (api_key_cache_s)")
    return 0


async def _erase(connection: Any, tenant: str) -> int:
    erased = await erase_tenant(connection, tenant)
    print(
        f"tenant {tenant}: {erased.requests} request(s); content removed from {erased.events} event(s),"
        f" {erased.tool_executions} tool execution(s) and {erased.inputs} recorded input(s)"
    )
    if erased.unfinished:
        print(f"{erased.unfinished} of them still open: erase again once they ended", file=sys.stderr)
    return 0


def _with_database(command: Callable[[Any], Awaitable[int]]) -> int:
    url, server = database_from_env()
    if server is not None:
        server.stop_on_signals()
    try:
        return asyncio.run(_in_transaction(url, command))
    except ProgrammingError as exc:
        print(f"the log's schema is not ready ({exc.orig}): run 'phasegate db upgrade'", file=sys.stderr)
        return 1
    finally:
        if server is not None:
            server.stop()


async def _in_transaction(url: str, command: Callable[[Any], Awaitable[int]]) -> int:
    engine = create_async_engine(url)
    try:
        async with engine.begin() as connection:
            return await command(connection)
    finally:
        await engine.dispose()
