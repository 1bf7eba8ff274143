"""Deployment files' gateway settings and worker commands, loaded by phasegate's own
configuration code.

Some settings the deployment files carry were added to the gateway's configuration
after the files named them (``drain_s``: gateway instances, docs/design.md §11;
``worker_token``: trust boundaries, §13). Until ``GatewayConfig`` has them they are set aside here, with a note
printed; once it has them they are loaded and validated like every other setting.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Any

from app.config import GatewayConfig, load_config
from app.worker.config import WorkerConfig, add_worker_parser, config_from_args

PENDING = {"drain_s": "the graceful drain", "worker_token": "worker authentication"}
DEFAULT_DRAIN_S = 30.0  # docs/design.md §11, until GatewayConfig carries drain_s


def load_gateway_settings(values: dict[str, Any]) -> GatewayConfig:
    known = {f.name for f in dataclasses.fields(GatewayConfig)}
    for name in sorted(set(values) & set(PENDING) - known):
        print(f"setting {name!r} set aside: GatewayConfig does not have it yet ({PENDING[name]})")
        values = {key: value for key, value in values.items() if key != name}
    return load_config(None, **values)


def drain_seconds(values: dict[str, Any]) -> float:
    """The drain a gateway with these settings allows its open streams."""
    if "drain_s" in values:
        return float(values["drain_s"])
    return float(getattr(GatewayConfig(), "drain_s", DEFAULT_DRAIN_S))


def load_worker_command(argv: Sequence[str]) -> WorkerConfig:
    """What ``phasegate worker ARGV`` would run with (SystemExit where it would refuse to start)."""
    parser = argparse.ArgumentParser(prog="phasegate")
    add_worker_parser(parser.add_subparsers(dest="command", required=True))
    return config_from_args(parser.parse_args(["worker", *argv]))
