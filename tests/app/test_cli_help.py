"""``--help`` is complete: each subcommand a description, each option a help text with its
default where it has one, and ``serve`` names the environment and the admin token."""

from __future__ import annotations

import argparse

import pytest

from app import cli


def parser_of(name: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="phasegate")
    sub = parser.add_subparsers(dest="command")
    module, adder = cli.PARSERS[name]
    cli._adder((module, adder))(sub)
    chosen: argparse.ArgumentParser = sub.choices[name]
    return chosen


@pytest.mark.parametrize("name", ["serve", "sql", "admin-token"])
def test_every_option_says_what_it_is(name: str) -> None:
    parser = parser_of(name)
    assert parser.description, f"phasegate {name} has no description"
    for action in parser._actions:
        assert action.help, f"phasegate {name} {action.option_strings or action.dest} has no help"


def test_serve_help_names_the_environment_the_admin_token_and_the_defaults() -> None:
    text = parser_of("serve").format_help()
    for needed in ("DATABASE_URL", "PHASEGATE_DATA_DIR", "admin-token", "phasegate sql", "default info", "default 2"):
        assert needed in text, needed
