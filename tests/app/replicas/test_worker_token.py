"""The gateway sends ``worker_token`` to its workers: real workers that require one, a real
gateway on real PostgreSQL, the real ``openai`` client."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from app.config import ConfigError, load_config
from app.contract.worker_token import TOKEN_ENV
from tests.support.gateway import MODEL, running_gateway
from tests.support.workers import WorkerProcess, running_worker

TOKEN = secrets.token_urlsafe(24)
SIM = ["--model", MODEL, "--sim-decode-ms-per-token", "2", "--heartbeat-ms", "100"]


@pytest.fixture(scope="module")
def guarded() -> Iterator[WorkerProcess]:
    with running_worker(token=TOKEN, args=SIM) as worker:
        yield worker


def test_the_gateway_streams_through_a_worker_that_requires_its_token(
    database_url: str, guarded: WorkerProcess
) -> None:
    with running_gateway(database_url, [guarded], worker_token=TOKEN) as gateway:
        stream = gateway.openai().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True, max_tokens=8
        )
        chunks = list(stream)
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_a_wrong_worker_token_is_the_replicas_failure_not_the_clients(
    database_url: str, guarded: WorkerProcess
) -> None:
    with running_gateway(database_url, [guarded], worker_token="a-wrong-token-0123456789") as gateway:
        with pytest.raises(openai.APIStatusError) as refused:
            gateway.openai().chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8
            )
        assert refused.value.status_code >= 500, refused.value.response.text  # not a 4xx blaming the request
        assert TOKEN not in refused.value.response.text and "a-wrong-token" not in refused.value.response.text


# --- the setting (no process needed) -------------------------------------------------------


def test_worker_token_comes_from_the_file_setting_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    token_file = tmp_path / "worker-token"
    token_file.write_text("token-from-a-file-0123\n")
    settings = tmp_path / "phasegate.toml"
    settings.write_text(f'worker_token_file = "{token_file}"\n')
    config = load_config(settings)
    assert config.worker_token == "token-from-a-file-0123"
    assert "token-from-a-file" not in repr(config)
    monkeypatch.setenv(TOKEN_ENV, "token-from-the-environment")
    assert load_config(settings).worker_token == "token-from-the-environment"  # the environment wins


@pytest.mark.parametrize(
    ("values", "why"),
    [
        ({"worker_token": "short"}, "at least 16"),
        ({"worker_token": "with a space 0123456789"}, "printable ASCII"),
        ({"worker_token": 12345678901234567890}, "must be a string"),
        ({"worker_token_file": "/nonexistent/worker-token"}, "cannot read"),
    ],
)
def test_an_unusable_worker_token_stops_the_start(
    values: dict[str, object], why: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(ConfigError, match=why):
        load_config(None, **values)
