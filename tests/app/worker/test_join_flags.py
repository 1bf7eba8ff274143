"""``phasegate worker``'s fleet flags: ``--model NAME=REV``, ``--join``, ``--advertise``
(docs/worker-protocol.md, "Joining the fleet")."""

from __future__ import annotations

import argparse
import re

import pytest

from app.worker.config import add_worker_parser, config_from_args
from app.worker.joiner import advertised


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_worker_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["worker", *argv])


def test_models_declare_their_revisions_and_join_takes_a_url() -> None:
    config = config_from_args(
        parse(["--model", "a=rev2", "--model", "b", "--join", "http://gw:8000", "--advertise", "http://10.0.0.5:9"])
    )
    assert config.models == ("a", "b") and config.revisions == (("a", "rev2"),)
    assert (config.join, config.advertise) == ("http://gw:8000", "http://10.0.0.5:9")
    assert config_from_args(parse([])).join is None


@pytest.mark.parametrize(
    ("argv", "why"),
    [
        (["--advertise", "http://10.0.0.5:9"], "--advertise goes with --join"),
        (["--join", "gw:8000"], "--join takes an http(s):// URL"),
        (["--model", "=rev"], "--model takes NAME or NAME=REVISION"),
    ],
)
def test_bad_fleet_flags_stop_the_start_with_a_message(argv: list[str], why: str) -> None:
    with pytest.raises(SystemExit, match=re.escape(why)):
        config_from_args(parse(argv))


def test_the_advertised_address_names_the_host_for_a_wildcard_bind() -> None:
    assert advertised("127.0.0.1", 9000) == "http://127.0.0.1:9000"
    assert advertised("::1", 9000) == "http://[::1]:9000"
    assert not advertised("0.0.0.0", 9000).startswith("http://0.0.0.0")
