"""deploy/kubernetes/ against the Kubernetes API schemas (kubernetes-validate, strict: unknown fields
fail), and against radixlm itself: the containers' arguments parse as `radixlm serve` / `radixlm router`
command lines, the router finds the replicas through the headless Service, probes hit /health, and the
grace period covers the server's shutdown."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import kubernetes_validate  # the dev extra installs it
import pytest
import yaml

from radixlm.server.args import ServerArgs
from radixlm.server.cli import build_parser

MANIFESTS = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes"
# The oldest Kubernetes release still supported upstream, and the newest the validator knows.
VERSIONS = ("1.32.0", kubernetes_validate.latest_version())


def _resources() -> list[tuple[str, dict]]:
    out = []
    for path in sorted(MANIFESTS.glob("*.yaml")):
        out += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return out


def _by_kind() -> dict[tuple[str, str], dict]:
    return {(doc["kind"], doc["metadata"]["name"]): doc for _, doc in _resources()}


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_passes_the_kubernetes_schemas(version: str) -> None:
    resources = _resources()
    assert len(resources) == 5
    for name, doc in resources:
        kubernetes_validate.validate(doc, version, strict=True)  # raises ValidationError naming the field


def test_the_validator_catches_a_misspelt_field() -> None:
    """The oracle can fail: a typo in a probe is refused."""
    doc = _by_kind()[("StatefulSet", "radixlm")]
    bad = yaml.safe_load(yaml.safe_dump(doc).replace("readinessProbe", "readynessProbe"))
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, VERSIONS[-1], strict=True)


def _container(doc: dict) -> dict:
    (container,) = doc["spec"]["template"]["spec"]["containers"]
    return container


def test_replicas_are_served_by_radixlm_serve_with_gpu_probes_and_the_model_volume() -> None:
    resources = _by_kind()
    sts, headless = resources[("StatefulSet", "radixlm")], resources[("Service", "radixlm-replicas")]
    container = _container(sts)
    ns = build_parser().parse_args(container["args"])  # exits (fails the test) on an unknown flag
    assert ns.command == "serve" and ns.host == "0.0.0.0" and ns.port == 30000
    assert ns.model_path.startswith(container["volumeMounts"][0]["mountPath"])
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert headless["spec"]["clusterIP"] == "None" and sts["spec"]["serviceName"] == "radixlm-replicas"
    assert headless["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    assert volumes["models"]["persistentVolumeClaim"]["claimName"] == "radixlm-models"
    assert ("PersistentVolumeClaim", "radixlm-models") in resources
    # SIGTERM's drain (the server's drain timeout where it has one) fits the grace period, with room
    drain = {f.name: f.default for f in dataclasses.fields(ServerArgs)}.get("drain_timeout", 10)
    assert sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= drain + 30


def test_the_router_finds_the_replicas_by_the_headless_service_name() -> None:
    resources = _by_kind()
    router = resources[("Deployment", "radixlm-router")]
    container = _container(router)
    env = {e["name"]: e.get("value") for e in container["env"]}
    args = [env["REPLICAS_DNS"] if a == "$(REPLICAS_DNS)" else a for a in container["args"]]
    ns = build_parser().parse_args(args)
    assert ns.command == "router" and ns.port == 30000
    assert ns.worker_dns == "radixlm-replicas.$(POD_NAMESPACE).svc.cluster.local:30000"
    assert ns.worker_dns.split(".")[0] == resources[("Service", "radixlm-replicas")]["metadata"]["name"]
    front = resources[("Service", "radixlm")]
    assert front["spec"]["selector"].items() <= router["spec"]["template"]["metadata"]["labels"].items()
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
