"""deploy/: the Kubernetes manifests against Kubernetes' own schemas (offline, PyPI
`kubernetes-validate`), and against tallow: the flags they pass exist and parse, the probes
hit tallow's probe routes on the port it listens on, the grace period covers the drain, and
the RayService's application arguments build tallow's Serve application. Fast."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
import yaml

from tallow.cli.main import build_parser
from tallow.server import paths

kubernetes_validate = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
# preStop's `sleep` action needs 1.30 or later; validate against a version clusters run.
K8S = "1.32"


def documents(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]


def validate(resource: dict) -> None:
    kubernetes_validate.validate(resource, K8S, strict=True)


def by_kind(docs: list[dict]) -> dict[str, dict]:
    return {d["kind"]: d for d in docs}


def test_the_manifests_are_valid_kubernetes():
    for doc in documents("kubernetes/tallow.yaml"):
        validate(doc)


def test_the_rayservice_pod_templates_are_valid_kubernetes():
    (service,) = documents("ray/rayservice.yaml")
    cluster = service["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for group in groups:  # KubeRay's CRD embeds core PodTemplateSpecs
        template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}}
        validate({**template, "template": group["template"]})
    with pytest.raises(kubernetes_validate.ValidationError):  # the check can fail
        bad = {**template, "template": {"spec": {"containers": [{"name": "x", "imagee": "y"}]}}}
        validate(bad)


def flag_values(args: list[str]) -> dict[str, str]:
    return dict(re.match(r"(--[\w-]+)=?(.*)", a).groups() for a in args if a.startswith("--"))


def test_the_deployment_runs_tallow_with_its_probes_and_flags():
    docs = by_kind(documents("kubernetes/tallow.yaml"))
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = container["args"]
    parsed = build_parser().parse_args(args)  # every flag exists, every value parses
    assert parsed.command == "serve"
    flags = flag_values(args)
    port = int(flags["--port"])
    (http,) = [p for p in container["ports"] if p["name"] == "http"]
    assert http["containerPort"] == port
    probes = {k: container[k]["httpGet"] for k in ("startupProbe", "livenessProbe")}
    probes["readinessProbe"] = container["readinessProbe"]["httpGet"]
    for probe in probes.values():
        assert probe["port"] in ("http", port)
    assert probes["livenessProbe"]["path"] == paths.HEALTH_LIVE
    assert probes["readinessProbe"]["path"] == paths.HEALTH_READY
    assert probes["startupProbe"]["path"] in paths.PROBES
    # SIGTERM comes after preStop; the drain must end inside the grace period.
    pause = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] > pause + float(flags["--shutdown-timeout"])
    service = docs["Service"]["spec"]
    assert service["selector"] == docs["Deployment"]["spec"]["selector"]["matchLabels"]
    assert service["ports"][0]["targetPort"] == "http"


def test_the_rayservice_builds_tallows_serve_application():
    pytest.importorskip("ray.serve", reason="needs tallow[ray]")
    from tallow.server.ray_app import RayAppConfig

    (service,) = documents("ray/rayservice.yaml")
    (application,) = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]
    module, attr = application["import_path"].split(":")
    builder = getattr(importlib.import_module(module), attr)
    config = RayAppConfig.from_args(application["args"])
    assert config.autoscaling() is not None  # min/max_replicas given
    assert builder(application["args"]) is not None
    cluster = service["spec"]["rayClusterConfig"]
    pin = re.search(r'"ray\[serve\]==([\d.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert cluster["rayVersion"] == pin
    (head,) = cluster["headGroupSpec"]["template"]["spec"]["containers"]
    assert {"name": "serve", "containerPort": 8000} in head["ports"]  # Serve's default port
    (worker,) = cluster["workerGroupSpecs"][0]["template"]["spec"]["containers"]
    assert float(worker["resources"]["requests"]["cpu"]) >= config.threads  # Ray reserves it
