"""``phasegate replicas``: the fleet's admin API from a shell (docs/runbook.md).

    phasegate replicas list
    phasegate replicas add ID URL [--kind worker|openai] [--model NAME[=REVISION]]...
    phasegate replicas cordon ID [--drain-s N]
    phasegate replicas uncordon ID
    phasegate replicas remove ID [--drain-s N]

Each talks to one gateway (``--gateway URL``, else ``$PHASEGATE_GATEWAY``, else
http://127.0.0.1:8000) with the admin token from ``--admin-token-file``, else
``$PHASEGATE_ADMIN_TOKEN``, else the one the embedded default keeps in its data directory
(``phasegate admin-token``: so the demo's fleet is one command away); any instance will do,
every instance applies the change within a second. A refusal prints its code and message
and exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import httpx

TOKEN_ENV = "PHASEGATE_ADMIN_TOKEN"
GATEWAY_ENV = "PHASEGATE_GATEWAY"
DEFAULT_GATEWAY = "http://127.0.0.1:8000"


def add_replicas_parser(sub: Any) -> None:
    p = sub.add_parser("replicas", help="the fleet: list, add, cordon, uncordon, remove replicas")
    p.add_argument("--gateway", help=f"a gateway's URL (default ${GATEWAY_ENV}, else {DEFAULT_GATEWAY})")
    p.add_argument(
        "--admin-token-file",
        type=Path,
        help=f"a file holding the admin token (default ${TOKEN_ENV}, else the embedded default's)",
    )
    p.add_argument("--json", action="store_true", help="print the gateway's JSON answer")
    actions = p.add_subparsers(dest="action", required=True)
    actions.add_parser("list", help="every replica: state, source, models and revisions, live attempts")
    add = actions.add_parser("add", help="add a replica (it must answer its health probe)")
    add.add_argument("id")
    add.add_argument("url")
    add.add_argument("--kind", choices=("worker", "openai"), default="worker")
    add.add_argument("--model", action="append", default=[], metavar="NAME[=REVISION]", help="repeatable")
    for name, what in (("cordon", "no new attempt"), ("remove", "cordon, then leave once its attempts end")):
        action = actions.add_parser(name, help=what)
        action.add_argument("id")
        action.add_argument("--drain-s", type=float, help="fence its live attempts after this many seconds")
    actions.add_parser("uncordon", help="take new attempts again").add_argument("id")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    token = _token(args)
    if token is None:
        print(
            f"phasegate replicas: no admin token: set ${TOKEN_ENV} or give --admin-token-file "
            "(the embedded default's is read from its data directory when there is one)",
            file=sys.stderr,
        )
        return 2
    base = (args.gateway or os.environ.get(GATEWAY_ENV) or DEFAULT_GATEWAY).rstrip("/")
    headers = {"authorization": f"Bearer {token}"}
    method, path, body, params = _call(args)
    try:
        with httpx.Client(base_url=base, headers=headers, timeout=30) as http:
            response = http.request(method, path, json=body, params=params)
    except httpx.HTTPError as exc:
        print(f"phasegate replicas: cannot reach {base}: {exc}", file=sys.stderr)
        return 1
    try:
        answer = response.json()
    except ValueError:
        print(f"phasegate replicas: {base} answered {response.status_code}, not JSON", file=sys.stderr)
        return 1
    if response.status_code >= 400:
        error = answer.get("error", {}) if isinstance(answer, dict) else {}
        print(f"phasegate replicas: {error.get('code')}: {error.get('message')}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(answer, indent=2))
    elif args.action == "list":
        _print_list(answer)
    else:
        _print_replica(answer)
    return 0


def _token(args: argparse.Namespace) -> str | None:
    if args.admin_token_file is not None:
        try:
            return args.admin_token_file.read_text().strip() or None
        except OSError as exc:
            print(f"phasegate replicas: cannot read {args.admin_token_file}: {exc}", file=sys.stderr)
            return None
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV]
    from app.store.admin_token import token_file  # only here: the store's package is heavy to import

    try:  # read, never made: a gateway that uses it made it
        return token_file().read_text().strip() or None
    except OSError:
        return None


def _call(args: argparse.Namespace) -> tuple[str, str, Any, dict[str, str]]:
    action = args.action
    if action == "list":
        return "GET", "/admin/replicas", None, {}
    if action == "add":
        return "POST", "/admin/replicas", {"id": args.id, "url": args.url, "kind": args.kind, "models": args.model}, {}
    path = f"/admin/replicas/{args.id}"
    drain = getattr(args, "drain_s", None)
    if action == "cordon":
        return "POST", f"{path}/cordon", ({"drain_s": drain} if drain is not None else None), {}
    if action == "uncordon":
        return "POST", f"{path}/uncordon", None, {}
    return "DELETE", path, None, ({"drain_s": str(drain)} if drain is not None else {})


def _models(replica: dict[str, Any]) -> str:
    names = []
    for model in replica.get("models", []):
        name = model["name"] + (f"={model['revision']}" if model.get("revision") else "")
        names.append(name if model.get("current", True) else f"{name} (not the configured revision)")
    return ", ".join(names) or "(every model)"


def _print_replica(replica: dict[str, Any]) -> None:
    leaving = " (leaving)" if replica.get("leaving") else ""
    print(f"{replica['id']}: {replica['state']}{leaving} since {replica['since']}, {replica['live_attempts']} live")


def _print_list(answer: dict[str, Any]) -> None:
    rows = [("ID", "STATE", "SOURCE", "KIND", "LIVE", "URL", "MODELS")]
    for r in answer.get("data", []):
        state = r["state"] + ("*" if r.get("leaving") else "")
        rows.append((r["id"], state, r["source"], r["kind"], str(r["live_attempts"]), r["url"], _models(r)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False)) + "  " + row[-1])
