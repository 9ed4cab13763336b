"""Render the Helm chart offline (helm-python-sdk: Helm's own engine, no binary, no cluster) and
check the manifests: core kinds against Kubernetes' schemas (kubernetes-validate, strict), the
RayCluster against KubeRay's CRD schema (deploy/crds/) with unknown fields refused."""

from __future__ import annotations

import copy
import functools
import json
import pathlib

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "deepinfer"
CRD_SCHEMA = ROOT / "deploy" / "crds" / "ray.io_rayclusters.v1.schema.json"
KUBERNETES_VERSION = "1.33.0"
"""The Kubernetes API the manifests are checked against (fixed: a new release of the checker must
not change what passes)."""
RELEASE, NAMESPACE = "demo", "inference"


def helm():
    return pytest.importorskip("helm_python", reason="the chart tests need helm-python-sdk (make install: dev extras)")


def render(values: dict | None = None) -> dict[str, list[dict]]:
    """template path -> the manifests it renders (NOTES.txt and empty documents left out)."""
    with helm().Chart.load(str(CHART)) as chart:
        files = chart.render(values=values or {}, name=RELEASE, namespace=NAMESPACE)
    out = {}
    for path, text in files.items():
        if path.endswith("NOTES.txt"):
            continue
        docs = [d for d in yaml.safe_load_all(text) if d]
        if docs:
            out[path.rsplit("/", 1)[-1]] = docs
    return out


def manifests(values: dict | None = None) -> list[dict]:
    return [m for docs in render(values).values() for m in docs]


def one(found: list[dict], kind: str) -> dict:
    matching = [m for m in found if m["kind"] == kind]
    assert len(matching) == 1, [m["kind"] for m in found]
    return matching[0]


def worker_group(raycluster: dict, name: str) -> dict:
    return next(g for g in raycluster["spec"]["workerGroupSpecs"] if g["groupName"] == name)


def validate(manifest: dict) -> None:
    """Raise on a manifest Kubernetes (or KubeRay's CRD) would refuse."""
    if manifest["apiVersion"] == "ray.io/v1":
        _validate_raycluster(manifest)
    elif manifest["apiVersion"].startswith("monitoring.coreos.com/"):
        _validate_servicemonitor(manifest)
    else:
        kv = pytest.importorskip("kubernetes_validate")
        kv.validate(manifest, KUBERNETES_VERSION, strict=True)


@functools.lru_cache(maxsize=1)
def _raycluster_validator():
    import jsonschema

    schema = json.loads(CRD_SCHEMA.read_text())["openAPIV3Schema"]
    return jsonschema.Draft202012Validator(_strict(copy.deepcopy(schema)))


def _strict(node):
    """The CRD schema with unknown fields refused: the API server prunes them silently, which would
    hide a misspelt field; `x-kubernetes-preserve-unknown-fields` keeps its meaning."""
    if isinstance(node, dict):
        if "properties" in node and "additionalProperties" not in node:
            if not node.get("x-kubernetes-preserve-unknown-fields"):
                node["additionalProperties"] = False
        for value in node.values():
            _strict(value)
    elif isinstance(node, list):
        for value in node:
            _strict(value)
    return node


def _validate_raycluster(manifest: dict) -> None:
    assert manifest["kind"] == "RayCluster"
    assert set(manifest["metadata"]) <= {"name", "namespace", "labels", "annotations"}, manifest["metadata"]
    _raycluster_validator().validate(manifest)


def _validate_servicemonitor(manifest: dict) -> None:
    """No schema of prometheus-operator's CRD ships here: its required shape only."""
    assert manifest["apiVersion"] == "monitoring.coreos.com/v1" and manifest["kind"] == "ServiceMonitor"
    spec = manifest["spec"]
    assert spec["selector"]["matchLabels"] and spec["endpoints"]
    for endpoint in spec["endpoints"]:
        assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout", "scheme"}, endpoint
