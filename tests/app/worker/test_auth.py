"""The worker protocol's shared secret (docs/design.md §13): a real worker started with a token.

Every call that starts, renews, cancels or lists attempts (admin included) gets 401
without the token or with a wrong one, and changes nothing; the probes stay open and
show no request ids.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.contract.worker_token import TOKEN_ENV
from app.replicas.base import Done, Heartbeat, Token
from app.replicas.worker_errors import TokenRefused
from app.worker.config import add_worker_parser, config_from_args
from statemachine.events import FailureKind
from tests.support.workers import WorkerProcess, request_id, running_worker

TOKEN = secrets.token_urlsafe(24)

PROTECTED: list[tuple[str, str]] = [
    ("POST", "/v1/attempts"),
    ("POST", "/v1/attempts/renew"),
    ("POST", "/v1/leases/renew"),
    ("POST", "/v1/attempts/cancel"),
    ("GET", "/v1/info"),
    ("GET", "/admin/attempts"),
    ("GET", "/admin/faults"),
    ("POST", "/admin/faults"),
    ("DELETE", "/admin/faults"),
    ("GET", "/no/such/path"),
]
WRONG = [
    pytest.param({}, id="no header"),
    # its last character changed ("y" where it ends in "x": an "x" put there left such a token right)
    pytest.param({"authorization": "Bearer " + TOKEN[:-1] + ("y" if TOKEN.endswith("x") else "x")}, id="wrong token"),
    pytest.param({"authorization": "Bearer " + TOKEN + "x"}, id="longer token"),
    pytest.param({"authorization": TOKEN}, id="no scheme"),
    pytest.param({"authorization": "Basic " + TOKEN}, id="wrong scheme"),
    pytest.param({"authorization": "Bearer"}, id="empty token"),
]


@pytest.fixture(scope="module")
def guarded() -> Iterator[WorkerProcess]:
    """A sim worker that requires TOKEN, faults enabled, 20 ms a token."""
    with running_worker(faults=True, token=TOKEN, args=["--sim-decode-ms-per-token", "20"]) as worker:
        yield worker


def _start_body(rid: str, *, attempt: int = 1, epoch: int = 1, tokens: int = 40) -> dict[str, Any]:
    return {
        "request_id": rid,
        "attempt": attempt,
        "lease_epoch": epoch,
        "lease_ttl_ms": 3000,
        "model": "sim",
        "prompt": "hello",
        "params": {"max_tokens": tokens, "ignore_eos": True},
    }


@pytest.mark.parametrize("headers", WRONG)
@pytest.mark.parametrize(("method", "path"), PROTECTED)
def test_every_protected_endpoint_refuses_a_missing_or_wrong_token(
    guarded: WorkerProcess, method: str, path: str, headers: dict[str, str]
) -> None:
    body = _start_body(request_id("auth")) if method == "POST" else None
    response = httpx.request(method, guarded.base_url + path, json=body, headers=headers, timeout=10)
    assert response.status_code == 401, response.text
    assert response.json()["error"]["code"] == "unauthorized"
    assert response.headers["www-authenticate"].startswith("Bearer")
    assert TOKEN not in response.text


def _admin(worker: WorkerProcess, path: str) -> Any:
    response = httpx.get(worker.base_url + path, headers={"authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert response.status_code == 200, response.text
    return response.json()


async def test_refused_calls_change_nothing(guarded: WorkerProcess) -> None:
    """An attacker who knows a live attempt's ids (cancel, a newer epoch, a long renew,
    a fault, a cancel that would tombstone the next attempt) moves nothing."""
    rid = request_id("victim")
    client = guarded.client()
    try:
        stream = await client.start(
            request_id=rid,
            attempt=1,
            lease_epoch=5,
            lease_ttl_s=3.0,
            model="sim",
            prompt="hello",
            params={"max_tokens": 40, "ignore_eos": True},
        )
        frames: list[Any] = []
        async with stream:
            frames.append(await anext(stream))  # admitted and running
            async with httpx.AsyncClient(base_url=guarded.base_url, timeout=10) as attacker:
                ref = {"request_id": rid, "attempt": 1, "lease_epoch": 5}
                refused = await asyncio.gather(
                    attacker.post("/v1/attempts/cancel", json=ref),
                    attacker.post("/v1/attempts", json=_start_body(rid, attempt=2, epoch=6)),
                    attacker.post("/v1/attempts/renew", json={**ref, "lease_ttl_ms": 600_000}),
                    attacker.post("/v1/leases/renew", json={"leases": [{**ref, "lease_ttl_ms": 600_000}]}),
                    attacker.post("/v1/attempts/cancel", json={**ref, "attempt": 3, "lease_epoch": 7}),
                    attacker.post("/admin/faults", json={"action": "die", "at_token": 2}),
                )
                assert [r.status_code for r in refused] == [401] * len(refused)
            frames += [frame async for frame in stream]
        assert isinstance(frames[-1], Done), frames[-1]
        assert sum(isinstance(f, Token) for f in frames) == 40
        assert all(isinstance(f, Heartbeat | Token | Done) for f in frames)
        (described,) = [a for a in _admin(guarded, "/admin/attempts")["attempts"] if a["request_id"] == rid]
        assert (described["attempt"], described["lease_epoch"], described["stop"]) == (1, 5, None)
        assert described["lease_remaining_ms"] < 3000  # the 600 s renewal never happened
        assert _admin(guarded, "/admin/faults")["faults"] == []
        # the refused cancel of attempt 3 left no tombstone: its start goes ahead
        third = await client.start(
            request_id=rid,
            attempt=3,
            lease_epoch=7,
            lease_ttl_s=3.0,
            model="sim",
            prompt="hello",
            params={"max_tokens": 2},
        )
        async with third:
            assert isinstance([f async for f in third][-1], Done)
    finally:
        await client.aclose()


async def test_the_probes_stay_open_and_show_no_request_ids(guarded: WorkerProcess) -> None:
    rid = request_id("secret-request-id")
    client = guarded.client()
    try:
        stream = await client.start(
            request_id=rid,
            attempt=1,
            lease_epoch=1,
            lease_ttl_s=3.0,
            model="sim",
            prompt="hello",
            params={"max_tokens": 30, "ignore_eos": True},
        )
        async with stream:
            await anext(stream)
            async with httpx.AsyncClient(base_url=guarded.base_url, timeout=10) as anyone:
                probes = [await anyone.get(path) for path in ("/v1/health", "/v1/ready", "/metrics")]
            assert [p.status_code for p in probes] == [200, 200, 200]
            assert all(rid not in p.text and "secret-request-id" not in p.text for p in probes)
            assert rid in str(_admin(guarded, "/admin/attempts"))  # it was live all along
    finally:
        await client.aclose()


async def test_a_client_with_the_wrong_token_gets_a_token_refused_error(guarded: WorkerProcess) -> None:
    client = guarded.client(token="not-the-token-at-all-0123")
    try:
        with pytest.raises(TokenRefused) as start:
            await client.start(
                request_id=request_id(), attempt=1, lease_epoch=1, lease_ttl_s=3.0, model="sim", prompt="x"
            )
        with pytest.raises(TokenRefused):
            await client.renew_many([(request_id(), 1, 1, 3.0)])
        with pytest.raises(TokenRefused):
            await client.cancel(request_id(), 1, 1)
        assert start.value.status == 401 and start.value.kind is FailureKind.REJECTED
        assert (await client.health()).healthy  # the probe needs no token
    finally:
        await client.aclose()


# --- where the token comes from (no process needed) ---------------------------------------


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_worker_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["worker", *argv])


def test_a_worker_off_loopback_without_a_token_refuses_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(SystemExit, match="needs a token"):
        config_from_args(_parse(["--host", "0.0.0.0"]))
    assert config_from_args(_parse(["--host", "0.0.0.0", "--insecure-no-auth"])).token is None
    assert config_from_args(_parse([])).token is None  # loopback: open, with a warning at start


def test_the_token_comes_from_a_file_or_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(TOKEN_ENV, "from-the-environment-123")
    assert config_from_args(_parse(["--host", "0.0.0.0"])).token == "from-the-environment-123"
    token_file = tmp_path / "token"
    token_file.write_text("from-a-file-0123456789\n")
    config = config_from_args(_parse(["--token-file", str(token_file)]))
    assert config.token == "from-a-file-0123456789"
    assert "from-a-file" not in repr(config)


@pytest.mark.parametrize(
    ("token", "why"), [("short", "at least 16"), ("has a space in it 0123", "printable ASCII"), ("é" * 20, "printable")]
)
def test_an_unusable_token_stops_the_start(monkeypatch: pytest.MonkeyPatch, token: str, why: str) -> None:
    monkeypatch.setenv(TOKEN_ENV, token)
    with pytest.raises(SystemExit, match=why) as refused:
        config_from_args(_parse([]))
    assert token not in str(refused.value)


def test_a_missing_token_file_stops_the_start(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="cannot read the worker token file"):
        config_from_args(_parse(["--token-file", str(tmp_path / "absent")]))
