"""``phasegate serve`` as a user runs it: a real process on its embedded defaults (its own
PostgreSQL, two sim workers), stopped with Ctrl-C as a terminal sends it (SIGINT to the
process group).

- it prints once a local URL with the admin token kept in its data directory (the same at
  every start), and that URL opens the list of requests; a configured token is never printed;
- the first Ctrl-C drains, the second ends the open stream with its final error
  (``gateway_draining``) and stops: no traceback, nothing it started left running;
- a Ctrl-C while it starts (PostgreSQL being created, migrations running) stops it the same
  quiet way.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ops.processes import REPO, phasegate

NOISE = ("Traceback", "KeyboardInterrupt", "Task was destroyed", "Exception ignored", "ERROR")

pytestmark = pytest.mark.slow


@pytest.fixture
def data_dir() -> Iterator[Path]:
    """The embedded PostgreSQL's home, where its own user can enter (pytest's tmp_path is 0700)."""
    path = Path(tempfile.mkdtemp(prefix="phasegate-serve-test-"))
    path.chmod(0o755)
    yield path / "data"
    shutil.rmtree(path, ignore_errors=True)


def launch(
    data_dir: Path, tmp_path: Path, *args: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], Path]:
    """``phasegate serve ARGS`` in a session of its own, as a shell runs a foreground job."""
    clean = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "PHASEGATE_WORKER_TOKEN")}
    clean["PHASEGATE_DATA_DIR"] = str(data_dir)
    output = tmp_path / "serve.log"
    with output.open("wb") as log:
        process = subprocess.Popen(
            phasegate("serve", *args),
            cwd=REPO,
            env={**clean, **(env or {})},
            start_new_session=True,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    return process, output


def ctrl_c(process: subprocess.Popen[bytes]) -> None:
    os.killpg(process.pid, signal.SIGINT)  # what a terminal sends its foreground job


def wait_for_line(output: Path, pattern: str, process: subprocess.Popen[bytes], timeout: float = 60) -> re.Match[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(pattern, output.read_text(errors="replace"))
        if found:
            return found
        if process.poll() is not None:
            break
        time.sleep(0.05)
    raise AssertionError(f"no {pattern!r} in the output:\n{output.read_text(errors='replace')}")


# Ctrl-C stops the embedded PostgreSQL with pg_ctl's own bound (EmbeddedPostgres's
# start_timeout, 60 s): a stop that takes longer than that is a fault, one under it is not
STOPPED_WITHIN_S = 90


def exited(process: subprocess.Popen[bytes], output: Path, timeout: float = STOPPED_WITHIN_S) -> int:
    """Its exit status once it stopped; a stop it did not make within ``timeout`` fails the
    test with what was still running and the end of what it printed, to say where it hung."""
    try:
        return process.wait(timeout)
    except subprocess.TimeoutExpired:
        left = "\n".join(describe(pid) for pid in sorted({process.pid, *children_of(process.pid)}))
        tail = "\n".join(output.read_text(errors="replace").splitlines()[-20:])
        end(process)
        raise AssertionError(
            f"phasegate serve still ran {timeout:g}s after Ctrl-C; still running:\n{left}\nits output ends:\n{tail}"
        ) from None


def describe(pid: int) -> str:
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return f"{pid} (gone)"
    return f"{pid} {state} {command[:200]}"


def children_of(pid: int) -> set[int]:
    """The processes whose parent is ``pid`` (its sim workers live in sessions of their own)."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.add(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def end(process: subprocess.Popen[bytes]) -> None:
    """After a failure: stop it as a service manager would (SIGTERM, then SIGKILL), children too."""
    children = children_of(process.pid)
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(5)
    for pid in children:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def assert_quiet_and_clean(output: Path, data_dir: Path) -> str:
    text = output.read_text(errors="replace")
    for noise in NOISE:
        assert noise not in text, text
    assert not (data_dir / "pgdata" / "postmaster.pid").exists(), "its PostgreSQL still runs"
    return text


@pytest.fixture(params=["1", "2"], ids=["one process", "two processes"])
def demo(
    data_dir: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[tuple[subprocess.Popen[bytes], Path, str]]:
    """The demo on its default one gateway process, and on two (``--processes 2``)."""
    processes = ["--processes", request.param] if request.param != "1" else []
    process, output = launch(data_dir, tmp_path, "--port", "0", "--sim-ms-per-token", "50", *processes)
    try:
        url = wait_for_line(output, r"(http://127\.0\.0\.1:\d+/ui/requests\?token=[\w-]+)", process).group(1)
        yield process, output, url
    finally:
        end(process)


def test_the_demo_prints_its_url_once_and_two_ctrl_c_stop_it_quietly(
    demo: tuple[subprocess.Popen[bytes], Path, str], data_dir: Path
) -> None:
    process, output, url = demo
    base = url.split("/ui/")[0]
    with httpx.Client(base_url=base, timeout=30, follow_redirects=True) as http:
        body = {"model": "phasegate-sim", "max_tokens": 3, "messages": [{"role": "user", "content": "Hello"}]}
        answered = http.post("/v1/chat/completions", json=body)
        assert answered.status_code == 200
        request_id = answered.headers["x-request-id"]
        page = http.get(url)  # the printed URL, as a browser opens it
        assert page.status_code == 200 and f'data-request="{request_id}"' in page.text
        assert "token" not in str(page.url)
        assert http.get(f"/ui/requests/{request_id}").status_code == 200  # the cookie opens the timeline
    token = url.rsplit("=", 1)[1]
    assert output.read_text().count(token) == 1  # printed once, nowhere else
    assert token == (data_dir / "admin-token").read_text().strip()  # the data directory's: the same next start

    lines: list[str] = []
    streaming = threading.Event()

    def stream() -> None:
        body = {"model": "phasegate-sim", "stream": True, "max_tokens": 400, "ignore_eos": True}
        body["messages"] = [{"role": "user", "content": "count slowly"}]
        with (
            httpx.Client(base_url=base, timeout=60) as http,
            http.stream("POST", "/v1/chat/completions", json=body) as r,
        ):
            for line in r.iter_lines():
                lines.append(line)
                if len(lines) > 6:
                    streaming.set()

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    assert streaming.wait(30)
    children = {pid: Path(f"/proc/{pid}/cmdline").read_text() for pid in children_of(process.pid)}
    workers = {pid for pid, command in children.items() if "worker" in command}
    gateways = {pid for pid, command in children.items() if "app.process.gateway_process" in command}
    count = int(wait_for_line(output, r"; (\d+) gateway process", process).group(1))
    assert len(workers) == 2 and len(gateways) == (count if count > 1 else 0)  # one serves in phasegate serve itself
    ctrl_c(process)
    wait_for_line(output, "phasegate drains", process, timeout=10)
    time.sleep(0.5)
    assert reader.is_alive()  # draining lets the stream run on
    ctrl_c(process)
    assert exited(process, output) == 0
    reader.join(10)
    finals = [json.loads(line[5:]) for line in lines if line.startswith("data:") and '"error"' in line]
    assert [final["error"]["code"] for final in finals] == ["gateway_draining"]
    assert lines[-1] == "data: [DONE]" or lines[-2:] == ["data: [DONE]", ""]
    text = assert_quiet_and_clean(output, data_dir)
    assert "open streams end now" in text
    assert not [pid for pid in workers | gateways if alive(pid)], "a child outlived phasegate serve"


@pytest.mark.parametrize("moment", ["PostgreSQL cluster created", "embedded PostgreSQL in"])
def test_ctrl_c_while_it_starts_stops_it_quietly(data_dir: Path, tmp_path: Path, moment: str) -> None:
    process, output = launch(data_dir, tmp_path, "--port", "0")
    try:
        wait_for_line(output, moment, process)
        workers = children_of(process.pid)
        ctrl_c(process)
        assert exited(process, output) == 128 + signal.SIGINT
    finally:
        end(process)
    assert_quiet_and_clean(output, data_dir)
    assert not [pid for pid in workers if alive(pid)], "a child outlived phasegate serve"


def test_a_configured_admin_token_is_never_printed(data_dir: Path, tmp_path: Path, database_url: str) -> None:
    token = "configured-admin-token-0123456789"
    config = tmp_path / "phasegate.toml"
    config.write_text(f'admin_token = "{token}"\n')
    process, output = launch(
        data_dir, tmp_path, "--port", "0", "--config", str(config), env={"DATABASE_URL": database_url}
    )
    try:
        line = wait_for_line(output, r"requests and their timelines: (.*)", process).group(1)
        assert line.endswith("/ui/requests (with the configured admin token)")
        wait_for_line(output, "SQL over the request log: phasegate sql", process)  # docs/audit.md's way in
        wait_for_line(output, "Ctrl-C drains", process)
        ctrl_c(process)
        assert exited(process, output) == 0
    finally:
        end(process)
    assert token not in output.read_text()


@pytest.mark.skipif(os.geteuid() != 0, reason="the server runs as a user of its own only when root starts it")
def test_a_data_directory_its_server_cannot_reach_is_said_in_one_line(tmp_path: Path) -> None:
    """Under a directory its user cannot enter (root's 0700 home), the embedded server cannot
    start: serve says why and what to change, with no traceback, and leaves nothing running."""
    closed = tmp_path / "closed"
    closed.mkdir(mode=0o700)
    process, output = launch(closed / "data", tmp_path, "--port", "0")
    try:
        assert exited(process, output) == 1
    finally:
        end(process)
    said = output.read_text()
    assert "phasegate serve: PostgreSQL runs as" in said and "PHASEGATE_DATA_DIR" in said, said
    assert "Traceback" not in said, said


@pytest.mark.parametrize("bad", ["0", "-1", "two"])
def test_processes_must_be_a_whole_number_of_at_least_one(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    from app.cli import main

    with pytest.raises(SystemExit) as stopped:
        main(["serve", "--processes", bad])
    assert stopped.value.code == 2  # argparse's usage error, before anything starts
    assert "--processes" in capsys.readouterr().err


async def test_a_stop_asked_while_it_started_stops_it_once_started(database_url: str) -> None:
    """A stop signal whose SystemExit a library swallowed during the start (a Ctrl-C in the
    migrations once left phasegate serving) is still seen: the server stops as soon as it
    started, and it is never announced."""
    from app.config import ReplicaConfig, load_config
    from app.process.gateway_process import run_gateway
    from app.process.serve import _bind

    listener = _bind("127.0.0.1", 0)
    replica = ReplicaConfig(id="absent", url="http://127.0.0.1:9")  # never asked: nothing is served
    config = load_config(None, port=listener.getsockname()[1], replicas=(replica,), apply_migrations=False)
    announced: list[bool] = []
    try:
        run = run_gateway(config, database_url, [listener], lambda: announced.append(True), stop_asked=lambda: 2)
        await asyncio.wait_for(run, 60)
    finally:
        listener.close()
    assert announced == []


def test_serve_with_no_sim_workers_is_ready_with_an_empty_fleet_until_a_worker_joins(
    data_dir: Path, tmp_path: Path
) -> None:
    from app.process.demo import DEMO_MODEL, DEMO_REVISION
    from tests.support.workers import running_worker

    token = "serve-fleet-worker-token-0123456789"
    process, output = launch(
        data_dir, tmp_path, "--port", "0", "--sim-workers", "0", env={"PHASEGATE_WORKER_TOKEN": token}
    )
    try:
        base = wait_for_line(output, r"phasegate is serving (http://127\.0\.0\.1:\d+)", process).group(1)
        assert "0 replica(s) configured: none" in output.read_text()
        body = {"model": "phasegate-sim", "max_tokens": 3, "messages": [{"role": "user", "content": "Hello"}]}
        with httpx.Client(base_url=base, timeout=30) as http:
            assert http.get("/readyz").status_code == 200
            refused = http.post("/v1/chat/completions", json=body)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "no_replica_available"
            args = ["--model", f"{DEMO_MODEL}={DEMO_REVISION}", "--worker-id", "joined-1", "--join", base]
            with running_worker(token=token, args=args):
                deadline = time.monotonic() + 10
                while (answered := http.post("/v1/chat/completions", json=body)).status_code != 200:
                    assert time.monotonic() < deadline, answered.text
                    time.sleep(0.1)
    finally:
        end(process)
