"""The ``phasegate`` command line."""

from __future__ import annotations

import argparse
import sys

from app.store.commands import add_db_parser


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="phasegate", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", help="run the gateway (not yet: the gateway issue builds it)")
    add_db_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "db":
        return int(args.run(args))
    if args.command == "serve":
        print("phasegate serve: not yet built; see the gateway issue", file=sys.stderr)
        return 2
    return 0  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())
