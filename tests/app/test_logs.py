"""The gateway's log lines: what each is about, as JSON, and never a secret.

First the parts on their own (a logger, a context, a formatter: nothing to fake). Then
a real ``phasegate serve --log-format json`` process over two real sim workers that
require a worker token, with API keys, an admin token and a metrics token configured:
requests are driven through it (answered, refused, cut by a stalled replica, left by
their client; the cut one resumed from the log, a cancel sent after the answered one
ended; the admin API and pages opened with the token, ``/metrics`` scraped), and
its captured output is read line by line: every line is JSON, names the gateway
instance (as PostgreSQL lists it), every line that names a request carries its
``request_id`` (and ``attempt`` where the request had one), and no secret appears.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from app.telemetry import logs
from ops.processes import REPO, phasegate, ready_port, stop, wait_http
from tests.app.conftest import SIM_ARGS
from tests.support.audit import fetch_sql
from tests.support.workers import WorkerProcess, running_worker

API_KEY = "sk-acme-4f9d2c7e1b8a6035"
ADMIN_TOKEN = "admin-7c1e9a3f5d2b8604"
WORKER_TOKEN = "worker-token-2b7f4e9c1a6d3058"
METRICS_TOKEN = "metrics-token-8e3a1f6c9d2b5047"
SECRETS = (API_KEY, ADMIN_TOKEN, WORKER_TOKEN, METRICS_TOKEN)
MODEL = "sim"


@contextlib.contextmanager
def captured(log_format: str) -> Iterator[io.StringIO]:
    """The root logger as ``phasegate serve`` sets it up, writing into a buffer."""
    root = logging.getLogger()
    before = (list(root.handlers), root.level)
    logs.configure("debug", log_format)
    buffer = io.StringIO()
    handler = root.handlers[-1]
    assert isinstance(handler, logging.StreamHandler)
    handler.setStream(buffer)
    try:
        yield buffer
    finally:
        root.handlers[:] = before[0]
        root.setLevel(before[1])


def test_a_line_names_the_request_bound_where_it_started_and_its_tasks() -> None:
    async def serve_one() -> None:
        logs.bind_request("req_one")
        logging.getLogger("phasegate.test").info("in the handler")
        await asyncio.get_running_loop().create_task(_in_a_task())
        await asyncio.get_running_loop().create_task(_in_a_task(), context=logs.detached())

    async def _in_a_task() -> None:
        logging.getLogger("phasegate.test").warning("in a task")

    async def app(scope: object, receive: object, send: object) -> None:
        await serve_one()

    middleware = logs.LogContext(app, instance=lambda: "gw_1", attempt_of=lambda rid: 2 if rid == "req_one" else None)
    with captured("json") as out:
        asyncio.run(middleware({}, _nothing, _discard))
        logging.getLogger("phasegate.test").info("outside", extra={"request_id": "req_x", "attempt": 5})
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    lines = [line for line in lines if line["logger"] == "phasegate.test"]  # not asyncio's own
    about = [(line["message"], line.get("request_id"), line.get("attempt"), line.get("instance")) for line in lines]
    assert about == [
        ("in the handler", "req_one", 2, "gw_1"),
        ("in a task", "req_one", 2, "gw_1"),  # a task the request started
        ("in a task", None, None, "gw_1"),  # a detached one: shared by many requests
        ("outside", "req_x", 5, None),  # what the call says wins
    ]
    assert all(line["level"] in ("info", "warning") and line["ts"].endswith("+00:00") for line in lines)


def test_a_registered_secret_is_redacted_even_in_an_exception() -> None:
    with captured("text") as out:
        logs.redact("hunter2-secret", None, "")
        try:
            raise RuntimeError("connect to postgresql://app:hunter2-secret@db/x failed")
        except RuntimeError:
            logging.getLogger("phasegate.test").exception("token %s", "hunter2-secret")
    assert "hunter2-secret" not in out.getvalue()
    assert out.getvalue().count(logs.REDACTED) == 3  # the message, the source line, the exception


def test_a_short_secret_is_redacted_where_it_stands_whole_not_inside_words() -> None:
    with captured("text") as out:
        logs.redact("k1", "a")  # a test's keys: short, and inside many words
        logging.getLogger("phasegate.test").warning("key k1 (Bearer k1) refused; k10 and ak1 are other keys")
        logging.getLogger("phasegate.test").warning("a replica answered: k1,a")
    first, second = [line.split("phasegate.test: ")[-1] for line in out.getvalue().splitlines()[-2:]]
    assert first == "key [redacted] (Bearer [redacted]) refused; k10 and ak1 are other keys"
    assert second == "[redacted] replica answered: [redacted],[redacted]"


async def _nothing() -> dict[str, str]:
    return {"type": "http.disconnect"}  # pragma: no cover - the app above never reads


async def _discard(message: object) -> None:
    return None  # pragma: no cover


@pytest.fixture
def workers() -> Iterator[list[WorkerProcess]]:
    with contextlib.ExitStack() as stack:
        yield [
            stack.enter_context(
                running_worker(
                    faults=True, token=WORKER_TOKEN, args=[*SIM_ARGS, "--worker-id", f"w{n}", "--log-format", "json"]
                )
            )
            for n in (1, 2)
        ]


def chat(http: httpx.Client, prompt: str, **body: object) -> httpx.Response:
    payload = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 6, **body}
    return http.post("/v1/chat/completions", json=payload, headers={"authorization": f"Bearer {API_KEY}"})


@pytest.mark.slow
def test_a_json_log_names_requests_and_instance_and_holds_no_secret(
    database_url: str, workers: list[WorkerProcess], tmp_path: Path
) -> None:
    config = tmp_path / "phasegate.toml"
    config.write_text(
        f'admin_token = "{ADMIN_TOKEN}"\nworker_token = "{WORKER_TOKEN}"\nmetrics_token = "{METRICS_TOKEN}"\n'
        f'[api_keys]\n"{API_KEY}" = "acme"\n[timeouts]\nstall_s = 1.0\nlease_ttl_s = 1.0\ncancel_ack_s = 1.0\n'
        '[routing]\nstrategy = "least_outstanding"\n'  # both workers get attempts, whatever the prompts
    )
    ready = tmp_path / "ready.json"
    command = phasegate("serve", "--processes", "1", "--config", str(config), "--port", "0", "--ready-file", str(ready))
    command += ["--log-format", "json"]
    command += ["--log-level", "debug", "--model", f"{MODEL}=rev"]
    command += [arg for n, w in enumerate(workers, 1) for arg in ("--replica", f"worker={w.base_url}#w{n}")]
    output, banner = tmp_path / "gateway.log", tmp_path / "gateway.out"
    with output.open("wb") as stderr, banner.open("wb") as stdout:  # log lines on stderr, the banner on stdout
        process = subprocess.Popen(
            command,
            cwd=REPO,
            env={**os.environ, "DATABASE_URL": database_url},
            start_new_session=True,
            stdout=stdout,
            stderr=stderr,
        )
    try:
        base = f"http://127.0.0.1:{ready_port(ready, process)}"
        wait_http(base + "/readyz")
        for worker in workers:  # "cut me" stalls after two tokens: the stream ends interrupted
            fault = {"action": "stall", "at_token": 2, "match": {"prompt_contains": "cut me"}}
            auth = {"authorization": f"Bearer {WORKER_TOKEN}"}
            assert httpx.post(worker.base_url + "/admin/faults", json=fault, headers=auth).status_code == 200
        with httpx.Client(base_url=base, timeout=30) as http:
            answered = chat(http, "hello")
            assert answered.status_code == 200
            refused = http.post("/v1/chat/completions", json={}, headers={"authorization": "Bearer sk-wrong"})
            assert refused.status_code == 401
            cut = chat(http, "cut me", stream=True)
            assert "upstream_decode_interrupted" in cut.text
            with http.stream(
                "POST",
                "/v1/chat/completions",
                json={
                    "model": MODEL,
                    "stream": True,
                    "max_tokens": 400,
                    "ignore_eos": True,
                    "messages": [{"role": "user", "content": "leave me"}],
                },
                headers={"authorization": f"Bearer {API_KEY}"},
            ) as left:  # the client reads a little, then leaves
                left_id = left.headers["x-request-id"]
                for n, _ in enumerate(left.iter_lines()):
                    if n > 4:
                        break
            tenant = {"authorization": f"Bearer {API_KEY}"}  # the cut stream resumed, a cancel after the end
            resumed = http.get(f"/v1/requests/{cut.headers['x-request-id']}/stream", headers=tenant)
            assert resumed.status_code == 200 and "upstream_decode_interrupted" in resumed.text
            late = http.post(f"/v1/requests/{answered.headers['x-request-id']}/cancel", headers=tenant)
            assert late.status_code == 200 and late.json()["status"] == "ended"
            admin = {"authorization": f"Bearer {ADMIN_TOKEN}"}
            assert http.get(f"/v1/requests/{answered.headers['x-request-id']}", headers=admin).status_code == 200
            assert http.get(f"/ui/requests?token={ADMIN_TOKEN}", follow_redirects=True).status_code == 200
            assert http.get("/metrics", headers={"authorization": f"Bearer {METRICS_TOKEN}"}).status_code == 200
            time.sleep(2.0)  # the left request's cancel and fence settle
    finally:
        stop(process, signal.SIGTERM, grace_s=30)
    worker_logs = {f"w{n}": worker.logs() for n, worker in enumerate(workers, 1)}
    text = output.read_text()
    for secret in SECRETS:
        assert secret not in banner.read_text()
        assert secret not in text, f"a secret is in the log: {secret[:6]}…"
    lines = [json.loads(line) for line in text.splitlines() if line.strip()]  # every line is JSON
    (instance,) = [row["instance_id"] for row in fetch_sql(database_url, "SELECT instance_id FROM gateway_instances")]
    (registered,) = [n for n, line in enumerate(lines) if line["message"].endswith("registered")]
    assert instance in lines[registered]["message"]
    served = lines[registered:]  # from then on every line names the instance
    assert all(line.get("instance") == instance for line in served), [line for line in served if "instance" not in line]
    ids = {answered.headers["x-request-id"], refused.headers["x-request-id"], cut.headers["x-request-id"], left_id}
    about: dict[str, list[dict[str, object]]] = {}
    for line in lines:
        named = set(re.findall(r"req_[0-9a-f]{24}", line["message"]))
        if len(named) == 1:  # a line about one request carries its id
            assert line.get("request_id") == named.pop(), line
        if line.get("request_id"):
            about.setdefault(str(line["request_id"]), []).append(line)
    assert ids <= set(about), f"no line about {ids - set(about)}"
    assert any("rejected" in line["message"] for line in about[refused.headers["x-request-id"]])
    with_attempt = [line for line in lines if line.get("attempt") is not None]
    assert with_attempt and all(line.get("request_id") for line in with_attempt)
    assert any(line.get("request_id") == left_id and line["attempt"] == 1 for line in with_attempt), about[left_id]
    # the resume and cancel routes' lines carry the request's id, the resumed stream's task included
    cut_id, answered_id = cut.headers["x-request-id"], answered.headers["x-request-id"]
    by_message = {line["message"]: line for line in lines}
    resuming = by_message[f"request {cut_id}: its stream resumes from delta 0"]
    sent = [line for line in lines if line["message"].startswith(f"request {cut_id}: resumed deltas 0..")]
    late_cancel = by_message[f"request {answered_id}: a cancel came after it ended (completed)"]
    assert [line.get("request_id") for line in (resuming, *sent, late_cancel)] == [cut_id, cut_id, answered_id]
    assert resuming.get("instance") == late_cancel.get("instance") == instance

    # the workers' lines (phasegate worker --log-format json): JSON, naming the worker, every
    # line about an attempt with its request id and attempt, and never the worker token
    cut_attempts: list[dict[str, object]] = []
    for name, worker_text in worker_logs.items():
        assert WORKER_TOKEN not in worker_text
        worker_lines = [json.loads(line) for line in worker_text.splitlines() if line.strip()]
        assert any(line["message"].startswith(f"worker {name} ready") for line in worker_lines)
        assert all(line.get("instance") == name for line in worker_lines), worker_lines
        about_attempts = [line for line in worker_lines if line["message"].startswith("attempt ")]
        assert about_attempts and all(line.get("request_id") and line.get("attempt") for line in about_attempts)
        assert {str(line["request_id"]) for line in about_attempts} <= set(about)  # the gateway's requests
        cut_attempts += [line for line in about_attempts if line["request_id"] == cut_id]
    # the cut request's attempt: admitted, then stopped by the gateway's fence, which cancels it and
    # lets go of its stream; on a loaded machine the worker may notice either first
    admitted, *stopped = [(line["message"], line["attempt"]) for line in cut_attempts]
    assert admitted == ("attempt admitted (running)", 1)
    assert stopped in (
        [("attempt stopped early: cancelled", 1)],
        [("attempt stopped early: disconnected", 1)],
    )
