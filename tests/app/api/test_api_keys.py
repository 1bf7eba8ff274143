"""API keys stored hashed (docs/design.md §13): ``phasegate keys``, configured
``sha256:`` digests and plain keys, over a real gateway, real sim workers and real
PostgreSQL, with the real ``openai`` client."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import signal
import time
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import openai
import pytest

from app import cli
from app.api.auth import Authenticator
from app.api.errors import Unauthorized
from app.config import load_config
from app.store import keys
from app.store.database import asyncpg_dsn
from app.store.postgres import PostgresEventStore
from ops.processes import phasegate, start_serving, stop, wait_http
from statemachine import events as ev
from tests.conftest import run_sync
from tests.support.gateway import MODEL, RunningGateway, running_gateway
from tests.support.workers import WorkerProcess

MESSAGES = [{"role": "user", "content": "Hello"}]


def keys_cli(
    database_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str
) -> tuple[int, str, str]:
    monkeypatch.setenv("DATABASE_URL", database_url)
    code = cli.main(["keys", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def create_key(database_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tenant: str):
    code, out, err = keys_cli(database_url, monkeypatch, capsys, "create", "--tenant", tenant)
    assert code == 0, err
    key = out.strip()
    key_id = err.split()[2]
    return key_id, key


async def stored_rows(database_url: str) -> list[dict[str, object]]:
    connection = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        return [dict(row) for row in await connection.fetch("SELECT * FROM api_keys ORDER BY created_at")]
    finally:
        await connection.close()


def tenant_of(gateway: RunningGateway, key: str) -> str:
    raw = gateway.openai(api_key=key).chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=2
    )
    accepted = gateway.events(raw.headers["x-request-id"])[0]
    assert isinstance(accepted, ev.RequestAccepted)
    return accepted.tenant


def refused(gateway: RunningGateway, key: str) -> openai.AuthenticationError:
    with pytest.raises(openai.AuthenticationError) as refusal:
        gateway.openai(api_key=key).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    return refusal.value


def test_keys_are_created_once_listed_without_the_key_and_revoked(
    database_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    key_id, key = create_key(database_url, monkeypatch, capsys, "team-a")
    assert key.startswith("pgk-") and len(key) > 40
    (row,) = run_sync(lambda: stored_rows(database_url))
    assert row["id"] == key_id and row["tenant"] == "team-a" and row["revoked_at"] is None
    assert row["key_sha256"] == hashlib.sha256(key.encode()).hexdigest()
    assert all(key not in str(value) for value in row.values())  # only its digest is kept

    code, listing, _ = keys_cli(database_url, monkeypatch, capsys, "list")
    assert code == 0 and key not in listing
    (line,) = listing.splitlines()
    assert line.split("\t")[:3] == [key_id, "team-a", f"sha256:{row['key_sha256'][:12]}"]  # type: ignore[index]
    assert line.endswith("\t-")

    assert keys_cli(database_url, monkeypatch, capsys, "revoke", key_id)[0] == 0
    code, _, err = keys_cli(database_url, monkeypatch, capsys, "revoke", key_id)
    assert code == 1 and "no unrevoked key" in err
    assert keys_cli(database_url, monkeypatch, capsys, "revoke", "key_unknown")[0] == 1
    (row,) = run_sync(lambda: stored_rows(database_url))
    assert row["revoked_at"] is not None
    code, listing, _ = keys_cli(database_url, monkeypatch, capsys, "list", "--tenant", "team-a")
    assert not listing.strip().endswith("\t-")
    assert keys_cli(database_url, monkeypatch, capsys, "list", "--tenant", "nobody")[1] == ""


def test_keys_need_the_schema(
    empty_database_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = keys_cli(empty_database_url, monkeypatch, capsys, "create", "--tenant", "team-a")
    assert code == 1 and out == "" and "phasegate db upgrade" in err


def test_a_gateway_takes_table_keys_configured_digests_and_plain_keys(
    database_url: str,
    sim_pair: list[WorkerProcess],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    key_id, table_key = create_key(database_url, monkeypatch, capsys, "team-a")
    secret_store_key = "sk-kept-in-a-secret-store"
    configured = {
        "sha256:" + hashlib.sha256(secret_store_key.encode()).hexdigest(): "team-b",
        "sk-plain": "team-c",
    }
    with running_gateway(database_url, sim_pair, api_keys=configured, api_key_cache_s=0.5) as gateway:
        assert tenant_of(gateway, table_key) == "team-a"
        assert tenant_of(gateway, secret_store_key) == "team-b"
        assert tenant_of(gateway, "sk-plain") == "team-c"
        error = refused(gateway, "sha256:" + hashlib.sha256(secret_store_key.encode()).hexdigest())
        assert error.code == "invalid_api_key"  # the digest is not a key
        assert refused(gateway, "pgk-wrong").response.headers["x-should-retry"] == "false"
        with gateway.http() as http:
            missing = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES})
            assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
            assert http.get("/v1/models").status_code == 401
            assert http.get("/v1/models", headers={"authorization": f"Bearer {table_key}"}).status_code == 200

        assert keys_cli(database_url, monkeypatch, capsys, "revoke", key_id)[0] == 0
        revoked_at = time.monotonic()
        while True:  # within the key cache's TTL
            try:
                tenant_of(gateway, table_key)
            except openai.AuthenticationError:
                break
            assert time.monotonic() - revoked_at < 0.5 + 1.0, "a revoked key kept working past the cache TTL"
            time.sleep(0.05)
        assert tenant_of(gateway, "sk-plain") == "team-c"


def test_the_first_key_created_closes_an_open_gateway_for_good(
    database_url: str,
    sim_pair: list[WorkerProcess],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    with running_gateway(database_url, sim_pair, api_key_cache_s=0.3) as gateway:
        assert tenant_of(gateway, "anything") == "default"  # open: no key anywhere
        key_id, key = create_key(database_url, monkeypatch, capsys, "team-a")
        time.sleep(0.4)
        assert refused(gateway, "anything").code == "invalid_api_key"
        assert tenant_of(gateway, key) == "team-a"
        assert keys_cli(database_url, monkeypatch, capsys, "revoke", key_id)[0] == 0
        time.sleep(0.4)
        refused(gateway, key)
        refused(gateway, "anything")  # revoking the last key does not open it again


def test_a_refused_database_is_a_503_not_a_500(database_url: str, sim_pair: list[WorkerProcess]) -> None:
    with running_gateway(database_url, sim_pair, api_keys={"sk-plain": "team-c"}) as gateway:
        gateway.call(gateway.gateway.ctx.store.close())  # nothing can be read any more
        with gateway.http(headers={"authorization": "Bearer pgk-not-configured"}) as http:
            answer = http.get("/v1/models")
            assert answer.status_code == 503 and answer.json()["error"]["code"] == "auth_unavailable"
            assert http.get("/v1/models", headers={"authorization": "Bearer sk-plain"}).status_code == 200


def test_secrets_are_never_in_the_server_log(
    database_url: str,
    sim_pair: list[WorkerProcess],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _, table_key = create_key(database_url, monkeypatch, capsys, "team-a")
    admin_token = "admin-token-0123456789"
    secrets = {
        table_key,
        "sk-plain-secret",
        admin_token,
        "pgk-a-wrong-key-offered",
        hashlib.sha256(table_key.encode()).hexdigest(),
    }
    config = tmp_path / "phasegate.toml"
    config.write_text(f'admin_token = "{admin_token}"\n[api_keys]\n"sk-plain-secret" = "team-b"\n')
    command = phasegate("serve", "--config", str(config), "--log-level", "debug")
    command += ["--replica", f"worker={sim_pair[0].base_url}#w1", "--model", f"{MODEL}=rev"]
    log = tmp_path / "gateway.log"
    process, url = start_serving(command, {"DATABASE_URL": database_url}, log)
    try:
        wait_http(url + "/readyz")
        for key in (table_key, "sk-plain-secret", "pgk-a-wrong-key-offered"):
            client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
            try:
                client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
            except openai.AuthenticationError:
                pass
            finally:
                client.close()
        with httpx.Client(base_url=url) as http:
            http.get("/v1/requests/req_nope", headers={"authorization": f"Bearer {admin_token}"})
            http.get("/v1/requests/req_nope", headers={"authorization": "Bearer pgk-a-wrong-key-offered"})
    finally:
        stop(process, signal.SIGTERM)
    text = log.read_text()
    assert "gateway instance" in text  # the log was written
    assert not [secret for secret in secrets if secret in text]


async def test_configured_digests_in_either_case_and_a_placeholder_that_matches_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    key = "sk-kept-elsewhere"
    digest = hashlib.sha256(key.encode()).hexdigest()
    config = load_config(None, api_keys={f"sha256:{digest.upper()}": "team-u", "sha256:CHANGE-ME": "team-p"})
    with caplog.at_level(logging.WARNING, logger="phasegate.api"):
        authenticator = Authenticator(config, store=None)
    assert await authenticator.tenant(f"Bearer {key}") == "team-u"
    with pytest.raises(Unauthorized):
        await authenticator.tenant("Bearer sha256:CHANGE-ME")
    assert "'team-p'" in caplog.text and "CHANGE-ME" not in caplog.text  # the tenant named, not the entry


async def test_requests_that_need_one_answer_meanwhile_share_one_query(event_store: PostgresEventStore) -> None:
    """When the cached answer is due, one query answers every request that asks
    meanwhile (each had taken a pooled connection of its own: at 100 streams the pool's
    overflow was opened and closed for them); a new query only once it is due again."""
    queries = []

    class CountedStore:  # the real store, its read connections counted
        def reading(self) -> Any:
            queries.append(True)
            return event_store.reading()

    now = [0.0]
    config = load_config(None)
    authenticator = Authenticator(config, CountedStore(), clock=lambda: now[0])
    assert await asyncio.gather(*(authenticator.tenant("") for _ in range(50))) == ["default"] * 50
    assert len(queries) == 1
    assert await authenticator.tenant("") == "default" and len(queries) == 1  # cached
    async with event_store.reading() as connection:
        _, key = await keys.create_key(connection, "team-s")
        await connection.commit()
    now[0] += config.api_key_cache_s  # due: the table has a key now, so one is required
    offered = [authenticator.tenant(f"Bearer {key}") for _ in range(30)]
    offered += [authenticator.tenant("Bearer pgk-not-a-key") for _ in range(30)]
    answers = await asyncio.gather(*offered, return_exceptions=True)
    assert answers[:30] == ["team-s"] * 30
    assert all(isinstance(answer, Unauthorized) for answer in answers[30:])
    assert len(queries) == 1 + 1 + 2  # any key; then each digest once
