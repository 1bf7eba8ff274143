"""``[[discover]]`` tables (app/discover_config.py): read from a file, each fault refused
with a message that names the table and the setting."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.config import ConfigError, load_config


def test_discover_tables_are_read_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "phasegate.toml"
    path.write_text(
        """
[models]
tiny = "r1"

[[discover]]
name = "vllm.default.svc.cluster.local"
port = 8000
kind = "openai"
models = ["tiny=r1"]
every_s = 5
nameserver = "10.96.0.10:53"

[[discover]]
name = "_worker._tcp.phasegate.svc.cluster.local"
srv = true
nameserver = "[fd00::10]"
"""
    )
    first, second = load_config(path).discover
    assert (first.name, first.port, first.kind, first.models) == (
        "vllm.default.svc.cluster.local",
        8000,
        "openai",
        (("tiny", "r1"),),
    )
    assert (first.every_s, first.nameserver, first.drain_s) == (5.0, ("10.96.0.10", 53), 30.0)
    assert (second.srv, second.port, second.kind, second.models) == (True, None, "worker", ())
    assert second.nameserver == ("fd00::10", 53)


@pytest.mark.parametrize(
    ("tables", "message"),
    [
        ({"name": "x", "port": 1}, r"one \[\[discover\]\] table per name"),
        ([{"name": "vllm.test"}], r"discover #1 \(vllm.test\): port must be a port number"),
        ([{"name": "vllm.test", "port": 70000}], "port must be a port number"),
        ([{"name": "not a name", "port": 1}], "name must be a DNS name"),
        ([{"name": "vllm.test", "port": 1, "srv": True}], "port is not set with srv = true"),
        ([{"name": "vllm.test", "srv": "yes"}], "srv must be true or false"),
        ([{"name": "vllm.test", "port": 1, "kind": "vllm"}], "kind must be one of worker, openai"),
        ([{"name": "vllm.test", "port": 1, "models": "tiny"}], "models must be a list"),
        ([{"name": "vllm.test", "port": 1, "models": ["tiny="]}], 'is not "NAME" or "NAME=REVISION"'),
        ([{"name": "vllm.test", "port": 1, "models": ["tiny", "tiny=r2"]}], "a model is named twice"),
        (
            [{"name": "vllm.test", "port": 1, "models": ["other"]}],
            r"discover \(vllm.test\): model 'other' is not in models",
        ),
        ([{"name": "vllm.test", "port": 1, "every_s": 0}], "every_s must be a number of seconds, at least 0.1"),
        ([{"name": "vllm.test", "port": 1, "drain_s": -1}], "drain_s must be a number of seconds"),
        (
            [{"name": "vllm.test", "port": 1, "nameserver": "dns.local:53"}],
            "an IP address \\(and port\\), not a host name",
        ),
        ([{"name": "vllm.test", "port": 1, "nameserver": "10.0.0.1:0"}], "the port must be 1-65535"),
        ([{"name": "vllm.test", "port": 1, "every": 5}], "unknown settings: every"),
        ([{"name": "vllm.test", "port": 1}, {"name": "VLLM.test.", "port": 2}], "'vllm.test' is named twice"),
    ],
)
def test_a_discover_table_that_cannot_be_used_is_refused_by_name(tables: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, discover=tables, models={"tiny": "r1"})
