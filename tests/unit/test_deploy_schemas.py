"""The deployment files are valid against their schemas, offline: the Kubernetes manifests against the
Kubernetes 1.30 OpenAPI schemas that kubernetes-validate ships (strict: no unknown fields), compose
against the compose-spec schema that check-jsonschema vendors.

KEDA's ScaledObject and TriggerAuthentication are CRDs, outside the Kubernetes schema; kubernetes-validate
has no schema for them, so they are skipped by name (only ``keda.sh`` kinds) and checked here for what
matters to Factmill: each scales a Deployment the manifests declare, on a queue the registry knows.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from check_jsonschema.builtin_schemas import get_builtin_schema
from kubernetes_validate.utils import validate as validate_kubernetes

import worker.jobs.celery_app  # noqa: F401  (registers every job kind)
from worker.jobs.registry import get_kind, kind_names

KUBERNETES_VERSION = "1.30"
CRD_GROUPS = ("keda.sh/",)  # validated below, not by kubernetes-validate

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"


def _documents() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return docs


DOCS = _documents()
BUILTIN = [(f, d) for f, d in DOCS if not d["apiVersion"].startswith(CRD_GROUPS)]
CRDS = [(f, d) for f, d in DOCS if d["apiVersion"].startswith(CRD_GROUPS)]


def test_every_manifest_is_either_builtin_or_a_keda_crd():
    assert BUILTIN and CRDS
    assert {d["kind"] for _, d in CRDS} <= {"ScaledObject"}


@pytest.mark.parametrize(
    "doc", [d for _, d in BUILTIN], ids=[f"{f}:{d['kind']}/{d['metadata']['name']}" for f, d in BUILTIN]
)
def test_manifest_is_valid_against_the_kubernetes_schema(doc):
    assert validate_kubernetes(doc, KUBERNETES_VERSION, strict=True) == KUBERNETES_VERSION


def _worker_queues(deployment: dict[str, Any]) -> set[str]:
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    return set(args[args.index("--queues") + 1].split(","))


def test_keda_scales_each_worker_on_the_jobs_of_its_queues_kinds():
    """On the jobs due or running (from Postgres), not on the Redis list: pods hold up to their
    concurrency of messages off it (acks_late), so it read ~0 while every pod was busy and KEDA scaled
    them in mid-job. A scaled Deployment declares no replicas (`kubectl apply` would reset them)."""
    deployments = {d["metadata"]["name"]: d for _, d in BUILTIN if d["kind"] == "Deployment"}
    scaled = [d for _, d in CRDS if d["kind"] == "ScaledObject"]
    assert scaled
    for obj in scaled:
        spec = obj["spec"]
        target = deployments[spec["scaleTargetRef"]["name"]]
        assert "replicas" not in target["spec"], target["metadata"]["name"]
        assert 0 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
        for trigger in spec["triggers"]:
            assert trigger["type"] == "prometheus"
            query = trigger["metadata"]["query"]
            due_kinds, running_kinds = re.findall(r'kind=~"([^"]+)"', query)
            expected = {k for k in kind_names() if get_kind(k).queue in _worker_queues(target)}
            assert set(due_kinds.split("|")) == set(running_kinds.split("|")) == expected, query
            # Due, not queued: jobs waiting out a provider outage scaled a pool to its maximum for nothing.
            assert query.startswith("sum(max by (kind) (factmill_jobs_due{") and 'status="running"' in query
            assert int(trigger["metadata"]["threshold"]) > 0
            # An empty answer (the scrape failing) must not read as "no jobs": KEDA's default
            # (ignoreNullValues true) left a queue scaled to zero for as long as it lasted, and cut a
            # busy extraction pool to its minimum mid-job. The fallback keeps what runs.
            assert trigger["metadata"].get("ignoreNullValues") == "false", query
        assert spec["fallback"]["replicas"] >= 1
        assert spec["fallback"]["behavior"] == "currentReplicasIfHigher"


def test_compose_is_valid_against_the_compose_spec():
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    schema = get_builtin_schema("vendor.compose-spec")
    jsonschema.validate(compose, schema, cls=jsonschema.Draft202012Validator)


def test_an_invalid_compose_file_is_rejected():
    """The schema really checks: a misspelt key fails."""
    schema = get_builtin_schema("vendor.compose-spec")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"services": {"api": {"imagee": "x"}}}, schema)


def test_an_invalid_manifest_is_rejected():
    bad = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "x"},
        "spec": {"replicas": "2"},
    }
    with pytest.raises(Exception, match=r"replicas|selector|template"):
        validate_kubernetes(bad, KUBERNETES_VERSION, strict=True)


def test_the_readme_deployment_exports_every_variable_compose_requires():
    # Compose checks ${VAR:?...} across the whole file: one missing from README's export line made
    # every `docker compose` command of the Deployment steps abort.
    required = set(re.findall(r"\$\{([A-Z_]+):\?", (REPO / "docker-compose.yml").read_text()))
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("### Deployment") :]
    [exports] = re.findall(r"^export (.+)$", section, re.MULTILINE)[:1]
    exported = {part.split("=", 1)[0] for part in exports.split()}
    assert required and required <= exported, required - exported


def test_every_pool_scales_in_one_pod_at_a_time():
    """cooldownPeriod governs only scaling to and from zero: between N and 1 the HPA's default dropped
    every surplus pod within seconds, running jobs and all (each a worker loss)."""
    for name, doc in CRDS:
        spec = doc["spec"]
        if spec.get("maxReplicaCount", 100) > 1:
            down = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
            assert down["policies"] == [{"type": "Pods", "value": 1, "periodSeconds": 300}], name
            assert down["stabilizationWindowSeconds"] >= 300, name
