"""The ``phasegate`` command line."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="phasegate", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", help="run the gateway (not yet: the gateway issue builds it)")
    from app.worker.config import add_worker_parser

    add_worker_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "worker":
        from app.worker.server import main as worker_main

        return worker_main(args)
    if args.command == "serve":
        print("phasegate serve: not yet built; see the gateway issue", file=sys.stderr)
        return 2
    return 0  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())
