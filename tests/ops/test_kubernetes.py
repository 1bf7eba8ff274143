"""deploy/kubernetes: every manifest against the Kubernetes schemas, the Prometheus
Operator's resources against their CRDs' schemas, and the manifests against each other.

- Built-in kinds: ``kubernetes-validate`` (strict: unknown fields are errors), for the
  oldest and the newest Kubernetes it knows of that we support.
- ServiceMonitor, PrometheusRule: the schemas in npm ``@kubernetes-models/prometheus-operator``
  (installed by ``.ci/kubernetes-models``), run by node. Without them: checked
  structurally below, and the test that needs them skips saying so (fails under
  ``PHASEGATE_REQUIRE_KUBERNETES_MODELS=1``).
- CloudNativePG's ``Cluster``: no package ships its schema, so it is checked structurally
  (the fields phasegate relies on, and their agreement with the Secret).
- The fleet: no pod name in any setting; each ``[[discover]]`` name is a headless Service
  in front of a Deployment of the right kind, on its port, scaled by an autoscaler; the
  settings are a ConfigMap mounted so that the kubelet updates it and a reload applies it.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import tempfile
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from app.config import GatewayConfig
from tests.ops.gateway_settings import drain_seconds, load_gateway_settings, load_worker_command

REPO = Path(__file__).resolve().parents[2]
BASE = REPO / "deploy" / "kubernetes"
KUBERNETES_VERSIONS = ("1.31.0", kubernetes_validate.latest_version())
OPERATOR_GROUPS = ("monitoring.coreos.com/", "postgresql.cnpg.io/")

Resource = dict[str, Any]


def kustomization() -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    return document


def resources() -> list[Resource]:
    found: list[Resource] = []
    for name in kustomization()["resources"]:
        found += [doc for doc in yaml.safe_load_all((BASE / name).read_text()) if doc]
    return found


def one(kind: str, name: str | None = None) -> Resource:
    (found,) = [r for r in resources() if r["kind"] == kind and name in (None, r["metadata"]["name"])]
    return found


def containers(workload: Resource) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = workload["spec"]["template"]["spec"]["containers"]
    return found


def gateway_settings() -> dict[str, Any]:
    return tomllib.loads(one("ConfigMap", "phasegate-settings")["data"]["phasegate.toml"])


def loaded_gateway_settings() -> GatewayConfig:
    """The settings file as a gateway pod loads it: its worker_token_file and admin_token_file
    (the Secret's, mounted) stand in temporary files here."""
    secret = one("Secret", "phasegate")["stringData"]
    with tempfile.TemporaryDirectory() as tmp:
        files = {}
        for setting, key in (("worker_token_file", "worker-token"), ("admin_token_file", "admin-token")):
            files[setting] = Path(tmp) / key
            files[setting].write_text(secret[key] + "\n")
        return load_gateway_settings({**gateway_settings(), **{k: str(v) for k, v in files.items()}})


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels, matchExpressions) applied to ``labels``."""
    if any(labels.get(key) != value for key, value in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        present = {"In": labels.get(key) in values, "NotIn": labels.get(key) not in values}
        present |= {"Exists": key in labels, "DoesNotExist": key not in labels}
        if not present[operator]:
            return False
    return True


def test_the_kustomization_lists_every_manifest() -> None:
    listed = set(kustomization()["resources"])
    on_disk = {path.name for path in BASE.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_builtin_manifest_matches_the_kubernetes_schema(version: str) -> None:
    checked = []
    for resource in resources():
        if resource["apiVersion"].startswith(OPERATOR_GROUPS):
            continue
        kubernetes_validate.validate(resource, version, strict=True)
        checked.append(resource["kind"])
    assert {"Deployment", "HorizontalPodAutoscaler", "PodDisruptionBudget", "Service", "Secret", "ConfigMap"} <= set(
        checked
    )


def test_the_schema_check_refuses_a_broken_manifest() -> None:
    broken = copy.deepcopy(one("Deployment", "phasegate-gateway"))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/readyz"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[-1], strict=True)
    broken = copy.deepcopy(one("Deployment", "phasegate-worker"))
    broken["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[-1], strict=True)


def test_the_gateway_probes_and_drains() -> None:
    deployment = one("Deployment", "phasegate-gateway")
    (gateway,) = containers(deployment)
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert gateway["livenessProbe"]["httpGet"]["path"] == "/healthz"
    drain = drain_seconds(gateway_settings())
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert drain + 5 <= grace <= drain + 60, f"grace {grace} s for a drain of {drain} s"
    assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    assert deployment["spec"]["replicas"] >= 2


def test_the_disruption_budget_keeps_a_gateway() -> None:
    deployment, budget = one("Deployment", "phasegate-gateway"), one("PodDisruptionBudget")
    assert budget["spec"]["selector"] == deployment["spec"]["selector"]
    assert selects(budget["spec"]["selector"], deployment["spec"]["template"]["metadata"]["labels"])
    assert budget["spec"]["maxUnavailable"] < deployment["spec"]["replicas"]


KINDS = {"vllm": "openai"}  # each discovered Deployment, and the replica kind it is (the workers join)


def test_the_replicas_are_discovered_never_named_and_each_kind_is_autoscaled() -> None:
    """No pod name in any setting: each [[discover]] name is a headless Service selecting the
    ready pods of a Deployment that serves the kind, the port and the models it says, with an
    autoscaler over it; the phasegate workers are not discovered but join by themselves."""
    settings = loaded_gateway_settings()
    assert settings.replicas == (), "no replica is named: they are discovered, or they join"
    text = one("ConfigMap", "phasegate-settings")["data"]["phasegate.toml"]
    assert "phasegate-worker-" not in text and "vllm-" not in text
    assert {entry.name for entry in settings.discover} == set(KINDS)
    scalers = {r["spec"]["scaleTargetRef"]["name"]: r for r in resources() if r["kind"] == "HorizontalPodAutoscaler"}
    for entry in settings.discover:
        service = one("Service", entry.name)
        assert service["spec"]["clusterIP"] == "None", "a headless service: one A record per ready pod"
        assert not service["spec"].get("publishNotReadyAddresses"), "a pod loading its weights is no replica yet"
        (port,) = [p for p in service["spec"]["ports"] if p["port"] == entry.port]
        deployment = one("Deployment", entry.name)
        pod = deployment["spec"]["template"]
        assert selects({"matchLabels": service["spec"]["selector"]}, pod["metadata"]["labels"])
        (container,) = pod["spec"]["containers"]
        assert port["targetPort"] in {p["name"] for p in container["ports"]}
        assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1
        assert "readinessProbe" in container
        assert entry.kind == KINDS[entry.name] and set(entry.model_names) <= set(settings.models)
        assert all(revision == settings.models[name] for name, revision in entry.models)
        served = [
            arg.split("=", 1)[1] for arg in container["args"] if arg.startswith(("--model=", "--served-model-name="))
        ]
        assert set(entry.model_names) <= set(served), (entry.name, served)
        scaler = scalers[entry.name]
        assert scaler["spec"]["scaleTargetRef"]["kind"] == "Deployment"
        assert 1 <= scaler["spec"]["minReplicas"] < scaler["spec"]["maxReplicas"]
        assert "replicas" not in deployment["spec"] or deployment["spec"]["replicas"] >= scaler["spec"]["minReplicas"]


def test_the_settings_are_a_configmap_that_a_reload_picks_up() -> None:
    """Mounted as a directory (a subPath mount is never updated), at the path the gateway
    reads, and the gateway writes the pid file `phasegate reload` needs on a writable volume."""
    deployment = one("Deployment", "phasegate-gateway")
    (gateway,) = containers(deployment)
    (volume,) = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if "configMap" in v]
    assert volume["configMap"]["name"] == "phasegate-settings"
    (mount,) = [m for m in gateway["volumeMounts"] if m["name"] == volume["name"]]
    assert "subPath" not in mount
    (item,) = volume["configMap"]["items"]
    assert f"--config={mount['mountPath']}/{item['path']}" in gateway["args"]
    (pid_file,) = [arg.split("=", 1)[1] for arg in gateway["args"] if arg.startswith("--pid-file=")]
    writable = [m["mountPath"] for m in gateway["volumeMounts"] if m["name"] == "tmp"]
    assert any(pid_file.startswith(path + "/") for path in writable)


def test_every_secret_reference_resolves() -> None:
    secrets = {r["metadata"]["name"]: r for r in resources() if r["kind"] == "Secret"}
    references = 0
    for workload in (one("Deployment", "phasegate-gateway"), one("Deployment", "phasegate-worker")):
        spec = workload["spec"]["template"]["spec"]
        for container in spec["containers"]:
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in secrets[ref["name"]]["stringData"]
                    references += 1
        for volume in spec.get("volumes", []):
            if "secret" in volume:
                for item in volume["secret"]["items"]:
                    assert item["key"] in secrets[volume["secret"]["secretName"]]["stringData"]
                    references += 1
            if "configMap" in volume:
                for item in volume["configMap"]["items"]:
                    assert item["key"] in one("ConfigMap", volume["configMap"]["name"])["data"]
                    references += 1
    assert references >= 5


def test_the_secret_holds_what_design_13_lists() -> None:
    data = one("Secret", "phasegate")["stringData"]
    assert urlsplit(data["DATABASE_URL"]).scheme == "postgresql"
    assert data["worker-token"]
    assert data["admin-token"]
    settings = gateway_settings()  # a ConfigMap: no secret in it, and keys only as digests
    assert "admin_token" not in settings and "worker_token" not in settings
    assert settings["api_keys"] and all(key.startswith("sha256:") for key in settings["api_keys"])
    loaded = loaded_gateway_settings()  # phasegate's own configuration code accepts it
    assert loaded.admin_token == data["admin-token"]
    assert settings["admin_token_file"] == mounted_secret_file(one("Deployment", "phasegate-gateway"), "admin-token")


def mounted_secret_file(workload: Resource, key: str) -> str:
    """Where ``workload``'s container finds the ``phasegate`` Secret's ``key``."""
    spec = workload["spec"]["template"]["spec"]
    (volume,) = [
        v for v in spec["volumes"] if "secret" in v and key in {i["key"] for i in v["secret"].get("items", [])}
    ]
    (item,) = [i for i in volume["secret"]["items"] if i["key"] == key]
    (mount,) = [m for m in containers(workload)[0]["volumeMounts"] if m["name"] == volume["name"]]
    return f"{mount['mountPath']}/{item['path']}"


def test_the_worker_token_reaches_both_ends(tmp_path: Path) -> None:
    """The gateway reads the mounted worker-token; the worker (off loopback, so it refuses to
    start without one) is given the same file, and its own option parsing accepts the command."""
    token = one("Secret", "phasegate")["stringData"]["worker-token"]
    settings = gateway_settings()
    assert settings["worker_token_file"] == mounted_secret_file(one("Deployment", "phasegate-gateway"), "worker-token")
    assert loaded_gateway_settings().worker_token == token
    token_file = tmp_path / "worker-token"
    token_file.write_text(token + "\n")

    workers = one("Deployment", "phasegate-worker")
    worker_file = mounted_secret_file(workers, "worker-token")
    args = containers(workers)[0]["args"]
    assert f"--token-file={worker_file}" in args
    image = (REPO / "deploy" / "worker" / "Dockerfile").read_text().splitlines()
    (entrypoint,) = [json.loads(line.split(" ", 1)[1]) for line in image if line.startswith("ENTRYPOINT ")]
    assert entrypoint[:2] == ["phasegate", "worker"]
    given = [arg.replace(worker_file, str(token_file)) for arg in args]
    config = load_worker_command(entrypoint[2:] + given)
    assert config.token == token and config.host == "0.0.0.0" and config.log_format == "json"


def test_the_workers_join_through_the_gateways_service_at_their_pods_address(tmp_path: Path) -> None:
    """Each worker pod joins the fleet by itself (docs/design.md §16): through the gateway's
    Service and port, advertising its pod's IP on its own port, each model at the revision
    the gateways serve; an autoscaler scales them, and no [[discover]] name lists them."""
    settings = loaded_gateway_settings()
    workers = one("Deployment", "phasegate-worker")
    (container,) = containers(workers)
    args = container["args"]
    (join,) = [urlsplit(arg.split("=", 1)[1]) for arg in args if arg.startswith("--join=")]
    service = one("Service", join.hostname)
    gateway_pod = one("Deployment", "phasegate-gateway")["spec"]["template"]
    assert selects({"matchLabels": service["spec"]["selector"]}, gateway_pod["metadata"]["labels"])
    assert join.port in {p["port"] for p in service["spec"]["ports"]}
    (advertise,) = [urlsplit(arg.split("=", 1)[1]) for arg in args if arg.startswith("--advertise=")]
    (pod_ip,) = [e for e in container["env"] if e["name"] == "POD_IP"]
    assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP" and advertise.netloc.startswith("$(POD_IP):")
    assert advertise.port in {p["containerPort"] for p in container["ports"]}
    token_file = tmp_path / "worker-token"
    token_file.write_text(one("Secret", "phasegate")["stringData"]["worker-token"] + "\n")
    given = [f"--token-file={token_file}" if a.startswith("--token-file=") else a for a in args]
    config = load_worker_command([*given, "--host=0.0.0.0"])
    assert config.join == f"http://{join.hostname}:{join.port}" and config.revisions
    assert all(settings.models[name] == revision for name, revision in config.revisions)
    assert "phasegate-worker" not in {entry.name for entry in settings.discover}
    scaler = [r for r in resources() if r["kind"] == "HorizontalPodAutoscaler"]
    assert any(r["spec"]["scaleTargetRef"]["name"] == "phasegate-worker" for r in scaler)


def test_the_cloudnativepg_cluster_and_the_database_url_agree() -> None:
    """Structural: no package ships CloudNativePG's CRD schema."""
    cluster = one("Cluster", "phasegate-db")
    assert cluster["apiVersion"] == "postgresql.cnpg.io/v1"
    spec = cluster["spec"]
    assert spec["instances"] >= 2 and spec["storage"]["size"]
    assert spec["postgresql"]["synchronous"]["number"] >= 1
    initdb = spec["bootstrap"]["initdb"]
    owner = one("Secret", initdb["secret"]["name"])
    assert owner["type"] == "kubernetes.io/basic-auth" and owner["stringData"]["username"] == initdb["owner"]
    url = urlsplit(one("Secret", "phasegate")["stringData"]["DATABASE_URL"])
    assert url.hostname == f"{cluster['metadata']['name']}-rw", "the read-write service, which follows the primary"
    assert (url.username, url.password) == (initdb["owner"], owner["stringData"]["password"])
    assert url.path.lstrip("/") == initdb["database"] and url.port == 5432


def test_the_servicemonitor_scrapes_gateways_and_workers() -> None:
    monitor = one("ServiceMonitor")
    services = [
        r
        for r in resources()
        if r["kind"] == "Service" and selects(monitor["spec"]["selector"], r["metadata"]["labels"])
    ]
    assert {s["metadata"]["labels"]["app.kubernetes.io/component"] for s in services} == {"gateway", "worker"}
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["path"] == "/metrics"
        for service in services:
            assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}


def kubernetes_models() -> Path | None:
    directory = Path(os.environ.get("PHASEGATE_KUBERNETES_MODELS") or REPO / "var" / "kubernetes-models")
    package = directory / "node_modules" / "@kubernetes-models" / "prometheus-operator"
    if shutil.which("node") and package.is_dir():
        return directory
    why = "the Prometheus Operator's schemas are missing (run .ci/kubernetes-models): checked structurally only"
    if os.environ.get("PHASEGATE_REQUIRE_KUBERNETES_MODELS"):
        pytest.fail(why + "; PHASEGATE_REQUIRE_KUBERNETES_MODELS forbids skipping")
    pytest.skip(why)
    return None


def validate_operator_resources(batch: list[Resource]) -> list[str | None]:
    models = kubernetes_models()
    result = subprocess.run(
        ["node", str(Path(__file__).with_name("kubernetes_models.mjs")), str(models)],
        input=json.dumps(batch),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    verdicts: list[str | None] = json.loads(result.stdout)
    return verdicts


def test_prometheus_operator_resources_match_their_crds() -> None:
    batch = [r for r in resources() if r["apiVersion"].startswith("monitoring.coreos.com/")]
    assert "ServiceMonitor" in {r["kind"] for r in batch}
    broken = copy.deepcopy(one("ServiceMonitor"))
    broken["spec"]["endpoints"] = {"port": "http"}  # an object, not a list
    *verdicts, refused = validate_operator_resources([*batch, broken])
    assert verdicts == [None] * len(batch)
    assert refused is not None and "endpoints" in refused
