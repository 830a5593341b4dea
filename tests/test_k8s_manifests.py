"""Offline checks of the Kubernetes manifests in deploy/kubernetes/ (no cluster, no kustomize, no network).

The kustomization is rendered here by a small subset of kustomize (`resources` and `images`; any other
field fails the test, so that a new one gets implemented here rather than ignored). Every rendered object,
and the model-loader pod, is validated against the Kubernetes OpenAPI schema shipped inside the PyPI
package kubernetes-validate, in strict mode (unknown fields are errors), with sockets blocked. Then the
facts this project depends on: ouro-serve's arguments (parsed by ouro-serve's own argument parser) and
ports, probes, the GPU limit, the model volume, the security context, the Prometheus annotations, the HPA,
the PodDisruptionBudget and the prometheus-adapter rule for ouro_num_requests_waiting. The PodMonitor
(a Prometheus Operator CRD, which kubernetes-validate has no schema for) is checked against the fields of
the operator's CRD that it may use, and against the pods and port it must scrape.
"""

from __future__ import annotations

import argparse
import copy
import re
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
import yaml

try:
    import kubernetes_validate
    from kubernetes_validate import utils as kv_utils
except ImportError as e:  # reported by the `validate` fixture as a failure, not a skip
    kubernetes_validate = None
    KV_IMPORT_ERROR: Exception | None = e
else:
    KV_IMPORT_ERROR = None

from ouro_backend.entrypoints import serve
from ouro_backend.serving.metrics import GAUGE_KEYS

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "kubernetes"
BASE = K8S / "base"
EXTRA_MANIFESTS = [K8S / "model-loader.yaml"]  # validated, not part of the kustomization
PODMONITOR = K8S / "podmonitor.yaml"  # a CRD of the Prometheus Operator: not part of the kustomization
KUBE_VERSION = "1.30"  # a version kubernetes-validate ships (1.25 ... 1.37 in 1.37.0)
HPA_METRIC = "ouro_num_requests_waiting"
MODEL_MOUNT = "/models"


# ---------------------------------------------------------------- a tiny kustomize

SUPPORTED_KUSTOMIZATION_FIELDS = {"apiVersion", "kind", "resources", "images", "namespace"}


def _split_image(image: str) -> tuple[str, str]:
    """('registry/name', '[:tag|@digest]') of an image reference."""
    if "@" in image:
        name, digest = image.split("@", 1)
        return name, "@" + digest
    slash = image.rfind("/")
    colon = image.rfind(":")
    if colon > slash:
        return image[:colon], image[colon:]
    return image, ""


def _set_images(obj: dict, images: list[dict]) -> None:
    spec = obj.get("spec", {})
    pod_spec = spec.get("template", {}).get("spec") if obj["kind"] != "Pod" else spec
    if not pod_spec:
        return
    for container in pod_spec.get("initContainers", []) + pod_spec.get("containers", []):
        name, suffix = _split_image(container["image"])
        for rule in images:
            if rule["name"] != name:
                continue
            new_name = rule.get("newName", name)
            if rule.get("digest"):
                suffix = "@" + rule["digest"]
            elif rule.get("newTag"):
                suffix = ":" + str(rule["newTag"])
            container["image"] = new_name + suffix


def render_kustomization(directory: Path) -> list[dict]:
    """kustomize build, for the fields in SUPPORTED_KUSTOMIZATION_FIELDS."""
    kfile = directory / "kustomization.yaml"
    assert kfile.is_file(), f"{directory} has no kustomization.yaml"
    k = yaml.safe_load(kfile.read_text())
    unsupported = set(k) - SUPPORTED_KUSTOMIZATION_FIELDS
    assert not unsupported, (
        f"{kfile}: {sorted(unsupported)} not implemented by this test's renderer "
        f"(tests/test_k8s_manifests.py render_kustomization): implement it there"
    )
    assert k.get("kind") == "Kustomization"
    objects: list[dict] = []
    for entry in k.get("resources", []):
        path = directory / entry
        assert path.exists(), f"{kfile}: resource {entry} does not exist"
        if path.is_dir():
            objects += render_kustomization(path)
        else:
            objects += [d for d in yaml.safe_load_all(path.read_text()) if d]
    for obj in objects:
        _set_images(obj, k.get("images", []))
        if k.get("namespace"):
            obj.setdefault("metadata", {})["namespace"] = k["namespace"]
    return objects


def load_yaml_files(paths: list[Path]) -> list[dict]:
    return [d for p in paths for d in yaml.safe_load_all(p.read_text()) if d]


@pytest.fixture(scope="module")
def rendered() -> list[dict]:
    return render_kustomization(BASE)


def only(objects: list[dict], kind: str) -> dict:
    found = [o for o in objects if o["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {[o['metadata']['name'] for o in found]}"
    return found[0]


@pytest.fixture(scope="module")
def deployment(rendered) -> dict:
    return only(rendered, "Deployment")


@pytest.fixture(scope="module")
def container(deployment) -> dict:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def serve_argv(container: dict) -> list[str]:
    """The arguments after `ouro-serve`, whether ouro-serve is the command or the first arg."""
    argv = list(container.get("command", [])) + list(container.get("args", []))
    assert "ouro-serve" in argv, f"the container does not run ouro-serve: {argv}"
    return argv[argv.index("ouro-serve") + 1 :]


class _Parsed(Exception):
    def __init__(self, namespace):
        self.namespace = namespace


def parse_ouro_serve_args(argv: list[str]) -> argparse.Namespace:
    """ouro-serve's own parser (built inside serve.main) on argv; main stops right after parsing."""
    original = argparse.ArgumentParser.parse_args

    def capture(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    argparse.ArgumentParser.parse_args = capture
    try:
        serve.main(argv)
    except _Parsed as parsed:
        return parsed.namespace
    except SystemExit as e:  # argparse rejected an argument
        raise AssertionError(f"ouro-serve rejects the manifest's arguments {argv} (exit {e.code})") from None
    finally:
        argparse.ArgumentParser.parse_args = original
    raise AssertionError("ouro-serve's main() did not parse its arguments")


@pytest.fixture(scope="module")
def serve_args(container) -> argparse.Namespace:
    return parse_ouro_serve_args(serve_argv(container))


@pytest.fixture(scope="module")
def serve_defaults() -> argparse.Namespace:
    return parse_ouro_serve_args([])


def named_ports(container: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container["ports"]}


def probe_port(container: dict, probe: dict) -> int:
    port = probe["httpGet"]["port"]
    return named_ports(container)[port] if isinstance(port, str) else port


def dockerfile_exposed_ports() -> list[int]:
    text = (ROOT / "docker" / "Dockerfile").read_text()
    ports = [int(p.split("/")[0]) for line in text.splitlines() if line.startswith("EXPOSE") for p in line.split()[1:]]
    assert ports, "docker/Dockerfile has no EXPOSE line"
    return ports


# ---------------------------------------------------------------- schema validation


@pytest.fixture
def validate(monkeypatch):
    """kubernetes_validate.validate in strict mode against KUBE_VERSION, with every socket refused."""
    if kubernetes_validate is None:
        pytest.fail(
            f"the PyPI package kubernetes-validate is not importable ({KV_IMPORT_ERROR!r}); it is in "
            f"the `test` extra of pyproject.toml: pip install -e '.[test]' (or pip install "
            f"kubernetes-validate)",
            pytrace=False,
        )
    shipped = [kv_utils.major_minor(v) for v in kv_utils.all_versions()]
    if KUBE_VERSION not in shipped:
        pytest.fail(
            f"kubernetes-validate {kubernetes_validate.__version__} ships no schema for Kubernetes "
            f"{KUBE_VERSION} (it has {shipped[0]}..{shipped[-1]}): change KUBE_VERSION",
            pytrace=False,
        )

    def no_network(*args, **kwargs):
        raise AssertionError("schema validation tried to use the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(socket, "getaddrinfo", no_network)

    def run(obj: dict) -> None:
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)

    return run


def test_kustomization_renders(rendered):
    kinds = sorted(o["kind"] for o in rendered)
    assert kinds == sorted(
        [
            "ConfigMap",
            "Deployment",
            "HorizontalPodAutoscaler",
            "PersistentVolumeClaim",
            "PodDisruptionBudget",
            "Service",
        ]
    )
    keys = [(o["kind"], o["metadata"]["name"]) for o in rendered]
    assert len(keys) == len(set(keys)), f"duplicate objects: {keys}"
    for o in rendered:  # the namespace is the user's choice (kubectl -n, or an overlay's `namespace:`)
        assert "namespace" not in o["metadata"], f"{o['kind']}/{o['metadata']['name']} hard-codes a namespace"


def test_renderer_agrees_with_kustomize(rendered):
    """Where kustomize (or kubectl's) is installed, the renderer above gives what it builds."""
    if shutil.which("kustomize"):
        cmd = ["kustomize", "build", str(BASE)]
    elif shutil.which("kubectl"):
        cmd = ["kubectl", "kustomize", str(BASE)]
    else:
        pytest.skip("neither kustomize nor kubectl is installed (the other tests still render the base)")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    built = [d for d in yaml.safe_load_all(out.stdout) if d]

    def key(o):
        return o["kind"], o["metadata"]["name"]

    assert sorted(rendered, key=key) == sorted(built, key=key)


def test_every_manifest_matches_the_kubernetes_schema(rendered, validate):
    errors = []
    for obj in rendered + load_yaml_files(EXTRA_MANIFESTS):
        where = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
        try:
            validate(obj)
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{where}: {'.'.join(map(str, e.path))}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError as e:
            errors.append(f"{where}: {e.message}")
    assert not errors, "schema errors (Kubernetes " + KUBE_VERSION + "):\n" + "\n".join(errors)


def test_strict_validation_catches_mistakes(deployment, validate):
    """The validator is not vacuous: a misspelled field, a wrong type and a missing field are errors."""
    typo = copy.deepcopy(deployment)
    typo["spec"]["template"]["spec"]["containers"][0]["readynessProbe"] = {}
    wrong_type = copy.deepcopy(deployment)
    wrong_type["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "eight thousand"
    missing = copy.deepcopy(deployment)
    del missing["spec"]["selector"]
    for bad in (typo, wrong_type, missing):
        with pytest.raises(kubernetes_validate.ValidationError):
            validate(bad)


# ---------------------------------------------------------------- the project's facts


def test_image_is_the_projects(container):
    k = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    assert [i["name"] for i in k["images"]] == ["ouro-triton"]
    assert container["image"] == "ouro-triton:latest"
    assert "-t ouro-triton" in (ROOT / "docker" / "Dockerfile").read_text()


def test_ouro_serve_arguments(container, serve_args, serve_defaults):
    assert serve_args.address == "0.0.0.0"  # reachable from the Service and the kubelet's probes
    assert (
        (serve_args.http_port, serve_args.grpc_port, serve_args.metrics_port)
        == (serve_defaults.http_port, serve_defaults.grpc_port, serve_defaults.metrics_port)
        == (8000, 8001, 8002)
    )
    assert serve_args.model and serve_args.model.startswith(MODEL_MOUNT + "/")
    engine_args = serve.parse_engine_args(serve_args.engine_arg)
    from ouro_backend.config import EngineConfig

    EngineConfig.from_strings({k: v for k, v in engine_args.items() if k != "model"})  # raises if invalid
    assert engine_args.get("device") in (None, "auto", "cuda"), "the pod's GPU is cuda:0; do not pin another"
    # ouro-serve stops waiting for readiness after --timeout: no sooner than the startupProbe gives up.
    startup = container["startupProbe"]
    budget = startup.get("initialDelaySeconds", 0) + startup["periodSeconds"] * startup["failureThreshold"]
    assert serve_args.timeout >= budget


def test_ports_match_ouro_serve_and_the_dockerfile(container, serve_args, rendered, deployment):
    ports = named_ports(container)
    assert ports == {"http": serve_args.http_port, "grpc": serve_args.grpc_port, "metrics": serve_args.metrics_port}
    assert sorted(ports.values()) == sorted(dockerfile_exposed_ports())
    service = only(rendered, "Service")
    assert service["spec"]["type"] == "ClusterIP"
    assert {p["name"]: (p["port"], p["targetPort"]) for p in service["spec"]["ports"]} == {
        name: (port, name) for name, port in ports.items()
    }
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_probes(container):
    ports = named_ports(container)
    for kind, path in [
        ("readinessProbe", "/v2/health/ready"),
        ("livenessProbe", "/v2/health/live"),
        ("startupProbe", "/v2/health/ready"),
    ]:
        probe = container[kind]
        assert probe["httpGet"]["path"] == path, kind
        assert probe_port(container, probe) == ports["http"] == 8000, kind
    startup = container["startupProbe"]
    budget = startup.get("initialDelaySeconds", 0) + startup["periodSeconds"] * startup["failureThreshold"]
    assert budget >= 15 * 60, "model load + CUDA graph capture take minutes: give the startupProbe >= 15 min"


def test_one_gpu_per_pod(container):
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) == 1
    names = {e["name"] for e in container.get("env", [])}
    # The device plugin picks the GPU; overriding these would hand the pod other GPUs or none.
    assert not names & {"NVIDIA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"}


def test_model_volume(deployment, container, rendered, serve_args):
    pvc = only(rendered, "PersistentVolumeClaim")
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    mount = mounts[MODEL_MOUNT]
    assert mount.get("readOnly") is True
    claim = volumes[mount["name"]]["persistentVolumeClaim"]
    assert claim["claimName"] == pvc["metadata"]["name"]
    assert claim.get("readOnly") is True
    assert serve_args.model.startswith(MODEL_MOUNT + "/")
    # Triton's Python backend talks to each model's stub through /dev/shm: more than the 64 MiB default.
    assert volumes[mounts["/dev/shm"]["name"]]["emptyDir"]["medium"] == "Memory"
    # The model loader fills the same claim.
    loader = only(load_yaml_files(EXTRA_MANIFESTS), "Pod")
    assert [v["persistentVolumeClaim"]["claimName"] for v in loader["spec"]["volumes"]] == [pvc["metadata"]["name"]]


def test_security_context(deployment, container, serve_args):
    pod = deployment["spec"]["template"]["spec"]
    psc, csc = pod.get("securityContext", {}), container["securityContext"]
    assert psc.get("runAsNonRoot") is True or csc.get("runAsNonRoot") is True
    uid = csc.get("runAsUser", psc.get("runAsUser"))
    assert isinstance(uid, int) and uid > 0
    assert csc["allowPrivilegeEscalation"] is False
    assert csc.get("privileged", False) is False
    assert csc["capabilities"]["drop"] == ["ALL"] and not csc["capabilities"].get("add")
    # SIGTERM -> ouro-serve stops tritonserver gracefully, waiting up to --stop-grace seconds.
    stop_timeout = serve_args.stop_grace
    pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    pre_stop_s = int(pre_stop[1]) if pre_stop[:1] == ["sleep"] else 0
    assert pod["terminationGracePeriodSeconds"] > stop_timeout + pre_stop_s


def test_prometheus_annotations(deployment, serve_args):
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(serve_args.metrics_port)
    assert annotations["prometheus.io/path"] == "/metrics"


def test_hpa_scales_the_deployment_on_the_waiting_queue(rendered, deployment):
    hpa = only(rendered, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": deployment["apiVersion"],
        "kind": "Deployment",
        "name": deployment["metadata"]["name"],
    }
    [metric] = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == HPA_METRIC
    assert HPA_METRIC in GAUGE_KEYS.values(), "the engine no longer exports the metric the HPA scales on"
    assert metric["pods"]["target"]["type"] == "AverageValue"
    assert float(metric["pods"]["target"]["averageValue"]) > 0
    lo, hi = hpa["spec"].get("minReplicas", 1), hpa["spec"]["maxReplicas"]
    assert 1 <= lo <= deployment["spec"]["replicas"] <= hi


def test_prometheus_adapter_rules_serve_the_hpa_metric(rendered):
    configmap = only(rendered, "ConfigMap")
    config = yaml.safe_load(configmap["data"]["config.yaml"])  # the key the prometheus-adapter chart mounts
    assert set(config) <= {"rules", "externalRules", "resourceRules"}
    served = []
    for rule in config["rules"]:
        series = re.match(r"\s*([A-Za-z_:][A-Za-z0-9_:]*)", rule["seriesQuery"])
        if not series or series.group(1) != HPA_METRIC:
            continue
        overrides = rule["resources"]["overrides"]
        assert overrides["namespace"] == {"resource": "namespace"}
        assert overrides["pod"] == {"resource": "pod"}
        assert 'namespace!=""' in rule["seriesQuery"] and 'pod!=""' in rule["seriesQuery"]
        for placeholder in ("<<.Series>>", "<<.LabelMatchers>>", "<<.GroupBy>>"):
            assert placeholder in rule["metricsQuery"]
        assert "rate(" not in rule["metricsQuery"], f"{HPA_METRIC} is a gauge"
        matches = rule.get("name", {}).get("matches") or "^(.*)$"
        m = re.search(matches, HPA_METRIC)
        assert m, f"name.matches {matches!r} does not match {HPA_METRIC}"
        as_ = rule["name"].get("as") or ("$1" if m.groups() else "")
        name = m.expand(as_.replace("$", "\\")) if as_ else m.group(0)
        served.append(name)
    assert served == [HPA_METRIC]


def test_pod_disruption_budget_guards_the_serving_pods_without_blocking_drains(rendered, deployment):
    """A drain evicts one serving pod at a time, and neither a single replica nor a pod that is not Ready
    (still loading, crash-looping) can block it for good."""
    pdb = only(rendered, "PodDisruptionBudget")
    assert pdb["apiVersion"] == "policy/v1"
    spec = pdb["spec"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert spec["selector"] == deployment["spec"]["selector"], "the budget must cover exactly the Deployment's pods"
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    assert ("minAvailable" in spec) != ("maxUnavailable" in spec)
    hpa = only(rendered, "HorizontalPodAutoscaler")
    min_replicas = hpa["spec"].get("minReplicas", 1)
    if "maxUnavailable" in spec:
        assert spec["maxUnavailable"] == 1, "one serving pod at a time"
    else:  # a minAvailable as large as the smallest replica count never lets a drain through
        assert isinstance(spec["minAvailable"], int) and spec["minAvailable"] < min_replicas, spec
    assert spec.get("unhealthyPodEvictionPolicy") == "AlwaysAllow"


# The fields of the Prometheus Operator's PodMonitor CRD (monitoring.coreos.com/v1, operator 0.7x-0.9x)
# that a PodMonitor here may use: what kubernetes-validate cannot check for a custom resource.
PODMONITOR_SPEC_FIELDS = {
    "selector",
    "podMetricsEndpoints",
    "namespaceSelector",
    "jobLabel",
    "podTargetLabels",
    "sampleLimit",
    "targetLimit",
    "labelLimit",
}
PODMONITOR_ENDPOINT_FIELDS = {
    "port",
    "path",
    "scheme",
    "interval",
    "scrapeTimeout",
    "honorLabels",
    "honorTimestamps",
    "relabelings",
    "metricRelabelings",
}


def duration_s(text: str) -> float:
    """Seconds of a Prometheus duration such as `5s`, `1m30s` or `500ms` (the CRD's pattern)."""
    parts = re.findall(r"(\d+)(ms|s|m|h)", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"not a Prometheus duration: {text!r}"
    return sum(int(n) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[u] for n, u in parts)


def test_podmonitor_scrapes_the_metrics_port_of_the_server_pods(deployment, container, serve_args, validate):
    """The PodMonitor that the README tells kube-prometheus-stack users to apply: the CRD's shape (the
    fields it may use, their types), the server pods' labels, the named metrics port and path, and the
    `namespace` / `pod` labels that the adapter rule needs (a PodMonitor target has them)."""
    [monitor] = load_yaml_files([PODMONITOR])
    assert (monitor["apiVersion"], monitor["kind"]) == ("monitoring.coreos.com/v1", "PodMonitor")
    assert set(monitor) == {"apiVersion", "kind", "metadata", "spec"}
    meta = monitor["metadata"]
    assert meta["name"] == "ouro-triton" and "namespace" not in meta  # applied with -n, as the rest
    assert all(isinstance(v, str) for v in meta.get("labels", {}).values())
    spec = monitor["spec"]
    assert set(spec) <= PODMONITOR_SPEC_FIELDS, (
        f"fields not in the PodMonitor CRD: {set(spec) - PODMONITOR_SPEC_FIELDS}"
    )
    assert {"selector", "podMetricsEndpoints"} <= set(spec)  # required by the CRD
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert set(spec["selector"]) == {"matchLabels"}
    assert spec["selector"]["matchLabels"].items() <= labels.items(), "selects no server pod"
    assert "namespaceSelector" not in spec, "the pods are in the PodMonitor's own namespace"
    [endpoint] = spec["podMetricsEndpoints"]
    assert set(endpoint) <= PODMONITOR_ENDPOINT_FIELDS, set(endpoint) - PODMONITOR_ENDPOINT_FIELDS
    assert named_ports(container)[endpoint["port"]] == serve_args.metrics_port  # a named container port
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert endpoint.get("path", "/metrics") == annotations["prometheus.io/path"] == "/metrics"
    assert endpoint.get("scheme", "http") == "http"
    seconds = {key: duration_s(endpoint[key]) for key in ("interval", "scrapeTimeout")}
    assert seconds["scrapeTimeout"] <= seconds["interval"], "Prometheus refuses a timeout above the interval"
    # Relabelling must not drop the labels the adapter maps to the HPA's pods.
    for rule in endpoint.get("relabelings", []) + endpoint.get("metricRelabelings", []):
        assert rule.get("action") not in ("labeldrop", "labelkeep"), rule
    # Its metadata is a plain ObjectMeta: what the schema says of it on a core object.
    probe = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta}
    validate(probe)


def test_readme_describes_every_file():
    readme = (K8S / "README.md").read_text()
    assert "kubectl apply -k deploy/kubernetes/base" in readme
    assert f"kubectl apply -n ouro -f deploy/kubernetes/{PODMONITOR.name}" in readme
    for path in sorted(BASE.iterdir()) + EXTRA_MANIFESTS + [PODMONITOR]:
        assert path.name in readme, f"deploy/kubernetes/README.md does not mention {path.name}"
