"""compose.yaml: valid against the Compose Specification's JSON schema, and consistent
with the files, ports and services it names.

The schema is the one check-jsonschema vendors (``vendor.compose-spec``, from the
compose-spec project by way of SchemaStore). Starting the file for real needs a
container runtime and a registry, which the development machines do not have.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from tests.ops.gateway_settings import load_gateway_settings, load_worker_command

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "compose.yaml"


def compose_schema() -> dict[str, Any]:
    text = resources.files("check_jsonschema.builtin_schemas.vendor").joinpath("compose-spec.json").read_text()
    schema: dict[str, Any] = json.loads(text)
    return schema


def compose_file() -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return document


def schema_errors(document: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft202012Validator(compose_schema())
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(document)]


def test_compose_file_matches_the_compose_specification() -> None:
    assert schema_errors(compose_file()) == []


def test_the_schema_refuses_a_broken_compose_file() -> None:
    """The schema check can fail: typical mistakes are reported."""
    broken = copy.deepcopy(compose_file())
    broken["services"]["gateway-1"]["ports"] = "8001:8000"  # a string, not a list
    broken["services"]["postgres"]["healthcheck"]["interval"] = 2  # a number, not a duration
    broken["services"]["worker-sim"]["restart_policy"] = "always"  # no such key
    errors = schema_errors(broken)
    assert len(errors) >= 3, errors


def test_services_are_the_ones_the_issue_asks_for() -> None:
    services = compose_file()["services"]
    assert services["postgres"]["image"].split(":")[0] == "postgres", "the official PostgreSQL image"
    gateways = [name for name, s in services.items() if "serve" in s.get("command", [])]
    assert len(gateways) == 2, gateways
    for name in gateways:
        assert services[name]["build"]["dockerfile"] == "Dockerfile"
        assert services[name]["environment"]["DATABASE_URL"].startswith("postgresql://")
        assert "@postgres:" in services[name]["environment"]["DATABASE_URL"]
    workers = [name for name, s in services.items() if "worker" in s.get("command", [])]
    assert [services[name]["command"][services[name]["command"].index("--engine") + 1] for name in workers] == ["sim"]
    for name in ("prometheus", "grafana"):
        assert name in services and ":" in services[name]["image"] and not services[name]["image"].endswith(":latest")


def test_every_mounted_file_exists() -> None:
    document = compose_file()
    for name, service in document["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (REPO / source).exists(), f"{name}: {source} does not exist"
    for name, config in document.get("configs", {}).items():
        assert (REPO / config["file"]).is_file(), f"config {name}: {config['file']} does not exist"


def test_the_gateways_configuration_loads_and_names_compose_services() -> None:
    document = compose_file()
    services = document["services"]
    config = load_gateway_settings(tomllib.loads((REPO / document["configs"]["gateway"]["file"]).read_text()))
    assert config.replicas, "the gateways need the sim worker as a replica"
    for replica in config.replicas:
        host, port = replica.url.removeprefix("http://").split(":")
        assert host in services, f"replica {replica.id}: no service {host}"
        command = services[host]["command"]
        assert command[command.index("--port") + 1] == port and command[command.index("--host") + 1] == "0.0.0.0"
        assert set(config.models) <= set(command[i + 1] for i, word in enumerate(command) if word == "--model")


def test_the_worker_starts_with_the_token_the_gateways_send(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off loopback a worker refuses to start without a token; the gateways send the same one."""
    services = compose_file()["services"]
    worker = services["worker-sim"]
    token = worker["environment"]["PHASEGATE_WORKER_TOKEN"]
    monkeypatch.setenv("PHASEGATE_WORKER_TOKEN", token)
    config = load_worker_command(worker["command"][1:])
    assert config.host == "0.0.0.0" and config.token == token
    for name in ("gateway-1", "gateway-2"):
        assert services[name]["environment"]["PHASEGATE_WORKER_TOKEN"] == token
    monkeypatch.delenv("PHASEGATE_WORKER_TOKEN")
    with pytest.raises(SystemExit, match="needs a token"):
        load_worker_command(worker["command"][1:])


def test_prometheus_scrapes_every_gateway_and_worker() -> None:
    services = compose_file()["services"]
    prometheus = yaml.safe_load((REPO / "ops/prometheus/prometheus.yml").read_text())
    targets = {t for job in prometheus["scrape_configs"] for s in job["static_configs"] for t in s["targets"]}
    expected = set()
    for name, service in services.items():
        command = service.get("command", [])
        if "serve" in command or "worker" in command:
            expected.add(f"{name}:{command[command.index('--port') + 1]}")
    assert targets == expected


def test_docker_compose_config_where_a_runtime_exists() -> None:
    docker = shutil.which("docker")
    if docker is None or subprocess.run([docker, "compose", "version"], capture_output=True, timeout=30).returncode:
        pytest.skip("no `docker compose` here: the file is checked against the Compose Specification's schema instead")
    result = subprocess.run(
        [docker, "compose", "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
