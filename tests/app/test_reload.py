"""Reading the configuration again (app/process/reload.py): what a reload may change, what it
refuses and names, and what ``serve`` made of the file at start (the port it picked, a
generated admin token, the demo's simulated workers) kept as it runs. The processes
themselves: tests/faults/test_reload.py."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from app.config import ConfigError, ReplicaConfig, load_config
from app.process.reload import ReloadRefused, Settings, needs_restart, pid_file_of, remove_pid_file, write_pid_file
from ops.processes import REPO

BASE = """
port = 8100
[models]
m = "r1"
[api_keys]
"key-one-0123456789" = "tenant-a"
[[replicas]]
id = "w1"
url = "http://127.0.0.1:9001"
"""


def settings(tmp_path: Path, text: str = BASE) -> tuple[Settings, Path]:
    path = tmp_path / "phasegate.toml"
    path.write_text(text)
    return Settings(path, {}, load_config(path)), path


def test_what_a_reload_may_change_is_applied_and_the_rest_kept_as_it_runs(tmp_path: Path) -> None:
    loaded, path = settings(tmp_path)
    # as serve ran it: a port picked, an admin token generated
    loaded.running = dataclasses.replace(loaded.started, port=8100, admin_token="generated-admin-token-0123456789")
    path.write_text(
        BASE.replace('m = "r1"', 'm = "r2"\nn = "r1"')
        + '\n[[replicas]]\nid = "w2"\nurl = "http://127.0.0.1:9002"\n'
        + "[tenant_limits.tenants.tenant-a]\nrequests_per_minute = 5\n[timeouts]\nfirst_token_hard_s = 30.0\n"
    )
    new = loaded.reread()
    assert new.models == {"m": "r2", "n": "r1"}
    assert [replica.id for replica in new.replicas] == ["w1", "w2"]
    assert new.tenant_limits.of("tenant-a").requests_per_minute == 5
    assert new.timeouts.first_token_hard_s == 30.0
    assert new.admin_token == "generated-admin-token-0123456789"  # kept as it runs, never re-read away


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (("port = 8100", "port = 8101"), "port"),
        (("port = 8100", 'port = 8100\ndatabase_url = "postgresql://elsewhere/db"'), "database_url"),
        (("port = 8100", "port = 8100\n[timeouts]\nconnect_s = 9.0"), "timeouts.connect_s"),
        (("port = 8100", "port = 8100\n[policy]\nmax_attempts = 5"), "policy"),
    ],
)
def test_a_setting_that_needs_a_restart_is_refused_by_name(tmp_path: Path, change: tuple[str, str], named: str) -> None:
    loaded, path = settings(tmp_path)
    path.write_text(BASE.replace(*change))
    with pytest.raises(ReloadRefused, match=rf"^{named} cannot change without a restart"):
        loaded.reread()


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (BASE + "\n[models\n", "cannot read"),
        (BASE + '\n[routing]\nfallbacks = ["nowhere"]\n', "fallback model 'nowhere' is not in models"),
        (BASE + '\n[[replicas]]\nid = "w1"\nurl = "http://127.0.0.1:9003"\n', "replica ids must be unique"),
        ("bogus = 1\n" + BASE, "unknown settings: bogus"),
    ],
)
def test_a_file_that_does_not_hold_together_is_refused_with_its_reason(tmp_path: Path, text: str, reason: str) -> None:
    loaded, path = settings(tmp_path)
    path.write_text(text)
    with pytest.raises(ReloadRefused, match=reason):
        loaded.reread()


def test_the_demos_simulated_workers_and_model_stay_while_the_file_names_none(tmp_path: Path) -> None:
    loaded, path = settings(tmp_path, 'port = 8100\n[api_keys]\n"key-one-0123456789" = "a"\n')
    sims = (ReplicaConfig("sim-1", "http://127.0.0.1:9101"), ReplicaConfig("sim-2", "http://127.0.0.1:9102"))
    loaded.running = dataclasses.replace(loaded.started, replicas=sims, models={"phasegate-sim": "sim-1"})
    path.write_text('port = 8100\n[api_keys]\n"key-two-0123456789" = "b"\n')
    new = loaded.reread()
    assert new.replicas == sims and new.models == {"phasegate-sim": "sim-1"}
    assert new.api_keys == {"key-two-0123456789": "b"}


def test_needs_restart_names_nothing_for_the_same_settings(tmp_path: Path) -> None:
    loaded, _ = settings(tmp_path)
    assert needs_restart(loaded.started, loaded.reread()) == []


def test_the_pid_file_is_the_data_dirs_with_the_embedded_database_and_removed_by_its_writer(tmp_path: Path) -> None:
    config = load_config(None, data_dir=tmp_path / "data")
    assert pid_file_of(config, None) == tmp_path / "data" / "phasegate.pid"
    assert pid_file_of(dataclasses.replace(config, database_url="postgresql://h/db"), None) is None
    assert pid_file_of(config, tmp_path / "x.pid") == tmp_path / "x.pid"
    path = tmp_path / "data" / "phasegate.pid"
    write_pid_file(path)
    path.write_text("1\n")  # another serve wrote it since: not this one's to remove
    remove_pid_file(path)
    assert path.exists()


def test_phasegate_reload_says_when_no_serve_runs_there(tmp_path: Path) -> None:
    (tmp_path / "phasegate.pid").write_text("1\n")  # init, not a phasegate serve
    command = [sys.executable, "-m", "app.cli", "reload"]
    for args in (["--data-dir", str(tmp_path / "nowhere")], ["--data-dir", str(tmp_path)]):
        answer = subprocess.run([*command, *args], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert answer.returncode == 1, answer.stdout
        assert "no running phasegate serve" in answer.stdout or "not a running phasegate serve" in answer.stdout


def test_the_admin_token_is_read_from_its_file_and_an_empty_one_refused(tmp_path: Path) -> None:
    token = tmp_path / "admin-token"
    token.write_text("an-admin-token-from-a-secret\n")
    assert load_config(None, admin_token_file=str(token)).admin_token == "an-admin-token-from-a-secret"
    token.write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        load_config(None, admin_token_file=str(token))
    with pytest.raises(ConfigError, match="cannot read admin_token_file"):
        load_config(None, admin_token_file=str(tmp_path / "missing"))


def test_what_serve_generated_at_start_is_no_change(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo's worker token, generated after the start's read and put in the environment
    for its workers, is read back with the file: not a change of worker_token."""
    loaded, _ = settings(tmp_path)
    token = "a-generated-worker-token-0123456789"
    loaded.running = dataclasses.replace(loaded.started, worker_token=token)
    monkeypatch.setenv("PHASEGATE_WORKER_TOKEN", token)
    assert loaded.reread().worker_token == token
    monkeypatch.setenv("PHASEGATE_WORKER_TOKEN", "another-worker-token-0123456789")
    with pytest.raises(ReloadRefused, match="worker_token cannot change"):
        loaded.reread()
