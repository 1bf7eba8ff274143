"""Configuration: the documented file loads as documented; bad settings are named."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from app.config import ConfigError, ReplicaConfig, Timeouts, load_config, parse_replica

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_the_documented_file_is_a_valid_configuration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DATABASE_URL", raising=False)
    monkeypatch.delenv("PHASEGATE_DATA_DIR", raising=False)
    (example,) = re.findall(r"```toml\n(.*?)```", DOC.read_text(), flags=re.S)
    path = tmp_path / "phasegate.toml"
    path.write_text(example)
    config = load_config(path)
    assert [r.kind for r in config.replicas] == ["worker", "openai"]
    assert config.replicas[0].models == ("tiny-llama",) and config.api_keys["sk-team-a"] == "team-a"
    assert config.policy.max_attempts == 2 and config.policy.retry_max_prompt_tokens == 8000
    assert config.timeouts.stall_s == 2.0 and config.limits.max_tokens == 4096
    assert config.timeouts.openai_first_token_s == 10.0
    assert config.model_revision("tiny-llama") == "2026-11-30"


def test_the_documented_file_lists_every_timeout() -> None:
    (example,) = re.findall(r"```toml\n(.*?)```", DOC.read_text(), flags=re.S)
    (section,) = re.findall(r"^\[timeouts\]\n(.*?)(?:^\[|\Z)", example, flags=re.S | re.M)
    documented = set(re.findall(r"^(\w+) =", section, flags=re.M))
    assert documented == {f.name for f in dataclasses.fields(Timeouts)}


def test_flags_and_environment_override_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "phasegate.toml"
    path.write_text('port = 9000\ndatabase_url = "postgresql://file/db"\n')
    monkeypatch.setenv("DATABASE_URL", "postgresql://env/db")
    config = load_config(path, port=9100)
    assert (config.port, config.database_url) == (9100, "postgresql://env/db")


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"colour": "blue"}, "unknown settings: colour"),
        ({"content_policy": "some"}, "content_policy must be one of"),
        ({"replicas": [{"id": "a", "url": "http://x"}, {"id": "a", "url": "http://y"}]}, "replica ids must be unique"),
        ({"replicas": [{"id": "a", "url": "http://x", "kind": "grpc"}]}, "kind must be one of"),
        ({"replicas": [{"id": "a", "url": "ftp://x"}]}, "url must be http"),
        ({"replicas": [{"id": "a"}]}, "bad setting"),
        ({"max_body_bytes": 10}, "at least 1024"),
        ({"timeouts": {"stall_s": 0}}, "must be positive"),
        ({"timeouts": {"first_token_soft_s": 9, "first_token_hard_s": 1}}, "must not exceed"),
        ({"timeouts": {"openai_first_token_s": 0}}, "openai_first_token_s must be positive"),
        ({"timeouts": {"openai_first_token_s": float("nan")}}, "openai_first_token_s must be positive"),
        ({"policy": {"max_attempts": 0}}, "at least 1"),
        ({"routing": {"strategy": "fastest"}}, "routing: strategy must be one of least_outstanding, prefix_affinity"),
        ({"routing": {"fallback": ["x"]}}, "unknown routing settings: fallback"),
        ({"models": {"a": "1"}, "routing": {"fallbacks": ["b"]}}, "fallback model 'b' is not in models"),
        ({"models": {"a": "1"}, "routing": {"models": {"b": {}}}}, "routing.models.b: no such model"),
        ({"routing": {"models": {"a": {"affinity_load_factor": 0.5}}}}, "affinity_load_factor must be at least 1"),
    ],
)
def test_bad_settings_are_named(values: dict[str, object], message: str) -> None:
    with pytest.raises((ConfigError, ValueError), match=message):
        load_config(None, **values)


def test_an_unreadable_file_is_named(tmp_path: Path) -> None:
    broken = tmp_path / "broken.toml"
    broken.write_text("port = ")
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(broken)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("http://h:1", ReplicaConfig(id="r3", url="http://h:1", kind="worker")),
        ("openai=http://h:2/#vllm", ReplicaConfig(id="vllm", url="http://h:2", kind="openai")),
        ("worker=http://h:3#w", ReplicaConfig(id="w", url="http://h:3", kind="worker")),
    ],
)
def test_replica_flags(text: str, expected: ReplicaConfig) -> None:
    assert parse_replica(text, 3) == expected


def test_a_replica_declares_each_model_s_revision() -> None:
    from app.config import ConfigError, replica_entry

    replica = replica_entry({"id": "r1", "url": "http://h:1", "models": ["a=rev2", "b"]})
    assert replica.models == ("a", "b") and replica.revision_of("a") == "rev2" and replica.revision_of("b") is None
    config = load_config(None, replicas=[{"id": "r1", "url": "http://h:1", "models": ["a=rev2"]}])
    assert config.replicas[0].revisions == (("a", "rev2"),)
    for bad in ("a", ["=rev"], [1]):
        with pytest.raises(ConfigError, match="NAME or NAME=REVISION"):
            replica_entry({"id": "r1", "url": "http://h:1", "models": bad})
