"""The Helm chart, rendered offline for the cases a deployment meets: defaults, a large decode pool
with EP 8, an encoder pool, autoscaling, an API key, each model source and the optional manifests.
Every manifest validates (Kubernetes' schemas strict at a fixed version; the RayCluster against
KubeRay's CRD); values land in the right worker group; wrong values and broken templates fail."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess

import pytest

from services.common.workers import POOL_DECODE, POOL_PREFILL
from services.controller.controller import PoolSpec
from services.controller.pools_config import parse_pools_config, with_placements
from tests.deploy.chart import CHART, helm, manifests, one, render, validate, worker_group

LARGE_DECODE = {
    "pools": {
        "decode": {
            "replicas": 2,
            "minReplicas": 1,
            "maxReplicas": 6,
            "gpus": 8,
            "expertParallelSize": 8,
            "cpu": "96",
            "memory": "1600Gi",
            "shmSize": "64Gi",
            "nodeSelector": {"node.kubernetes.io/instance-type": "p5.48xlarge"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "extraResources": {"vpc.amazonaws.com/efa": 32},
        }
    }
}


def head_script(raycluster: dict) -> str:
    container = raycluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    return container["args"][0]


def pools_file(found: list[dict]):
    config_map = next(m for m in found if m["kind"] == "ConfigMap" and m["metadata"]["name"].endswith("-pools"))
    return json.loads(config_map["data"]["pools.json"])


def test_defaults_render_valid_manifests_with_a_prefill_and_a_decode_group():
    found = manifests()
    for manifest in found:
        validate(manifest)
    kinds = sorted(m["kind"] for m in found)
    assert kinds == ["ConfigMap", "PodDisruptionBudget", "PodDisruptionBudget", "RayCluster", "Service", "Service"]
    raycluster = one(found, "RayCluster")
    spec = raycluster["spec"]
    assert spec["enableInTreeAutoscaling"] is True
    assert [g["groupName"] for g in spec["workerGroupSpecs"]] == ["prefill", "decode"]  # no encoder pool
    assert worker_group(raycluster, "prefill")["rayStartParams"]["resources"] == '"{\\"deepinfer_prefill\\": 1}"'
    head = spec["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"  # engines never land on the head
    container = head["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    script = head_script(raycluster)
    assert "'--prefill=1' '--decode=1' '--encoder=0'" in script  # no encoder group: the PEs encode images
    assert "--autoscale" not in script and "--api-key" not in script
    assert "--model" not in script  # the embedded model
    services = [m for m in found if m["kind"] == "Service"]
    assert sorted((s["metadata"]["name"], [p["port"] for p in s["spec"]["ports"]]) for s in services) == [
        ("demo-deepinfer-grpc", [50051]),
        ("demo-deepinfer-http", [8000]),
    ]
    assert all(
        s["spec"]["selector"] == {"ray.io/cluster": "demo-deepinfer", "ray.io/node-type": "head"} for s in services
    )


def test_the_head_script_is_valid_bash_and_starts_ray_without_blocking():
    script = head_script(one(manifests({"apiKey": {"value": "k"}}), "RayCluster"))
    assert "${KUBERAY_GEN_RAY_START_CMD/--block/}" in script and "exec deepinfer" in script
    assert subprocess.run(["bash", "-n", "-c", script], capture_output=True).returncode == 0


def test_a_large_decode_pool_with_ep_8_lands_in_the_decode_group():
    found = manifests(LARGE_DECODE)
    for manifest in found:
        validate(manifest)
    raycluster = one(found, "RayCluster")
    decode, prefill = worker_group(raycluster, "decode"), worker_group(raycluster, "prefill")
    assert (decode["replicas"], decode["minReplicas"], decode["maxReplicas"]) == (2, 1, 6)
    pod = decode["template"]["spec"]
    limits = pod["containers"][0]["resources"]["limits"]
    assert limits == {"cpu": "96", "memory": "1600Gi", "nvidia.com/gpu": 8, "vpc.amazonaws.com/efa": 32}
    assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": "p5.48xlarge"}
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert decode["rayStartParams"]["resources"] == '"{\\"deepinfer_decode\\": 1}"'  # one 8-GPU engine per pod
    assert prefill["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "nodeSelector" not in prefill["template"]["spec"]
    assert "'--decode=2'" in head_script(raycluster)
    placements = parse_pools_config(pools_file(found)).placements
    assert (placements[POOL_DECODE].gpus, placements[POOL_DECODE].resource) == (8, "deepinfer_decode")
    assert placements[POOL_PREFILL].gpus == 1
    assert parse_pools_config(pools_file(found)).ep_sizes[POOL_DECODE] == 8  # 8 ranks of one GPU each


def test_engines_per_pod_are_the_pod_s_gpus_over_the_ep_size():
    values = {
        "pools": {"decode": {"replicas": 3, "minReplicas": 1, "maxReplicas": 3, "gpus": 8, "expertParallelSize": 2}}
    }
    found = manifests(values)
    decode = worker_group(one(found, "RayCluster"), "decode")
    assert decode["rayStartParams"]["resources"] == '"{\\"deepinfer_decode\\": 4}"'
    assert "'--decode=12'" in head_script(one(found, "RayCluster"))
    assert pools_file(found)["pools"]["decode"]["gpusPerEngine"] == 2
    config = parse_pools_config(pools_file(found))  # each engine an instance of 2 ranks, one GPU each
    assert config.ep_sizes == {POOL_DECODE: 2, POOL_PREFILL: 1}
    assert with_placements(PoolSpec(), config).ep_sizes == {POOL_DECODE: 2}


def test_an_encoder_pool_gets_its_own_group_resource_and_budget():
    found = manifests({"pools": {"encoder": {"enabled": True, "gpus": 2}}})
    assert "expertParallelSize" not in pools_file(found)["pools"]["encoder"]  # nothing to shard
    for manifest in found:
        validate(manifest)
    raycluster = one(found, "RayCluster")
    assert [g["groupName"] for g in raycluster["spec"]["workerGroupSpecs"]] == ["encoder", "prefill", "decode"]
    assert worker_group(raycluster, "encoder")["rayStartParams"]["resources"] == '"{\\"deepinfer_encoder\\": 2}"'
    assert "'--encoder=2'" in head_script(raycluster)  # 2 GPUs per pod, one engine each
    budgets = {
        m["spec"]["selector"]["matchLabels"]["ray.io/group"] for m in found if m["kind"] == "PodDisruptionBudget"
    }
    assert budgets == {"encoder", "prefill", "decode"}


def test_autoscaling_on_hands_the_controller_its_bounds_in_engines():
    values = {
        "autoscaling": {"enabled": True, "scaleInCooldownSeconds": 300},
        "pools": {"decode": {"replicas": 1, "minReplicas": 1, "maxReplicas": 4, "gpus": 8, "expertParallelSize": 4}},
    }
    found = manifests(values)
    assert "'--autoscale'" in head_script(one(found, "RayCluster"))
    config = parse_pools_config(pools_file(found))
    decode, prefill = config.rules[POOL_DECODE], config.rules[POOL_PREFILL]
    assert (decode.min_replicas, decode.max_replicas, decode.scale_in_cooldown_s) == (2, 8, 300)
    assert (decode.target_requests, decode.target_kv_usage) == (64, 0.8)
    assert (prefill.min_replicas, prefill.max_replicas, prefill.target_queued_prompt_tokens) == (1, 4, 8192)
    assert config.planner.interval_s == 5 and config.planner.replace_dead


def head_container(raycluster: dict) -> dict:
    return raycluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]


def test_api_keys_come_from_a_secret_as_the_environment_never_as_arguments():
    found = manifests({"apiKey": {"value": "s3cret,other"}})
    for manifest in found:
        validate(manifest)
    secret = one(found, "Secret")
    assert base64.b64decode(secret["data"]["api-key"]) == b"s3cret,other"  # several keys, comma-separated
    raycluster = one(found, "RayCluster")
    env = head_container(raycluster)["env"]
    ref = next(e for e in env if e["name"] == "DEEPINFER_API_KEYS")["valueFrom"]["secretKeyRef"]
    assert ref == {"name": secret["metadata"]["name"], "key": "api-key"}
    assert "--api-key" not in head_script(raycluster) and "s3cret" not in head_script(raycluster)
    existing = manifests({"apiKey": {"existingSecret": "team-keys", "secretKey": "token"}})
    assert not [m for m in existing if m["kind"] == "Secret"]
    env = head_container(one(existing, "RayCluster"))["env"]
    assert next(e for e in env if e["name"] == "DEEPINFER_API_KEYS")["valueFrom"]["secretKeyRef"] == {
        "name": "team-keys",
        "key": "token",
    }
    assert not [e for e in env if e["name"] == "DEEPINFER_CLUSTER_TOKEN"]  # by default the head makes one


def test_a_cluster_token_from_a_secret():
    found = manifests({"clusterToken": {"existingSecret": "internal", "secretKey": "t"}})
    env = head_container(one(found, "RayCluster"))["env"]
    ref = next(e for e in env if e["name"] == "DEEPINFER_CLUSTER_TOKEN")["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "internal", "key": "t"}


@pytest.mark.parametrize("client_ca", [False, True])
def test_tls_from_a_secret_on_both_api_ports(client_ca):
    found = manifests({"gateway": {"tls": {"existingSecret": "gateway-tls", "clientCA": client_ca}}})
    for manifest in found:
        validate(manifest)
    raycluster = one(found, "RayCluster")
    script, container = head_script(raycluster), head_container(raycluster)
    assert "'--ssl-certfile=/etc/deepinfer-tls/tls.crt' '--ssl-keyfile=/etc/deepinfer-tls/tls.key'" in script
    assert ("--ssl-ca-certs=/etc/deepinfer-tls/ca.crt" in script) == client_ca
    volumes = raycluster["spec"]["headGroupSpec"]["template"]["spec"]["volumes"]
    assert {"name": "tls", "secret": {"secretName": "gateway-tls"}} in volumes
    assert {"name": "tls", "mountPath": "/etc/deepinfer-tls", "readOnly": True} in container["volumeMounts"]
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        if client_ca:  # the kubelet has no client certificate: a TCP connection is all it can check
            assert container[probe]["tcpSocket"] == {"port": "http"}
        else:
            assert container[probe]["httpGet"]["scheme"] == "HTTPS"
    plain = head_container(one(manifests(), "RayCluster"))
    assert "scheme" not in plain["readinessProbe"]["httpGet"] and "--ssl" not in head_script(
        one(manifests(), "RayCluster")
    )


@pytest.mark.parametrize(
    "model, volume, argument",
    [
        (
            {"source": "pvc", "pvc": {"claimName": "weights"}, "path": "llama-8b"},
            "persistentVolumeClaim",
            "/models/llama-8b",
        ),
        ({"source": "hostPath", "hostPath": {"path": "/data/llama"}}, "hostPath", "/models"),
        ({"source": "image", "path": "/opt/model"}, None, "/opt/model"),
    ],
)
def test_the_model_reaches_every_pod_from_its_source(model, volume, argument):
    found = manifests({"model": model})
    for manifest in found:
        validate(manifest)
    raycluster = one(found, "RayCluster")
    assert f"'--model={argument}'" in head_script(raycluster)
    pods = [raycluster["spec"]["headGroupSpec"]["template"]["spec"]]
    pods += [g["template"]["spec"] for g in raycluster["spec"]["workerGroupSpecs"]]
    for pod in pods:
        volumes = {v["name"]: v for v in pod["volumes"]}
        if volume is None:
            assert "model" not in volumes
            continue
        assert volume in volumes["model"]
        mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
        assert mounts["model"] == {"name": "model", "mountPath": "/models", "readOnly": True}


def test_the_optional_manifests_render_valid_and_can_be_left_out():
    values = {
        "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
        "networkPolicy": {"enabled": True, "clients": [{"namespaceSelector": {"matchLabels": {"team": "apps"}}}]},
    }
    found = manifests(values)
    for manifest in found:
        validate(manifest)
    monitor = one(found, "ServiceMonitor")
    assert monitor["spec"]["endpoints"] == [
        {"port": "http", "path": "/metrics", "interval": "15s", "scrapeTimeout": "10s"}
    ]
    assert monitor["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "http"
    policy = one(found, "NetworkPolicy")["spec"]
    assert policy["ingress"][0]["from"] == [{"podSelector": {"matchLabels": {"ray.io/cluster": "demo-deepinfer"}}}]
    assert policy["ingress"][1]["from"][0]["namespaceSelector"] == {"matchLabels": {"team": "apps"}}
    bare = manifests({"podDisruptionBudget": {"enabled": False}})
    assert not [m for m in bare if m["kind"] in ("PodDisruptionBudget", "ServiceMonitor", "NetworkPolicy")]


@pytest.mark.parametrize(
    "values, message",
    [
        ({"pools": {"decode": {"replicas": -1}}}, "at '/pools/decode/replicas': minimum: got -1, want 0"),
        (
            {"pools": {"decode": {"gpus": 8, "expertParallelSize": 3}}},
            "at '/pools/decode/expertParallelSize': value must be one of 1, 2, 4, 8",
        ),
        (
            {"pools": {"decode": {"gpus": 0, "expertParallelSize": 2}}},
            "at '/pools/decode/expertParallelSize': value must be 1",
        ),
        ({"pools": {"vision": {"replicas": 1}}}, "at '/pools': additional properties 'vision' not allowed"),
        ({"pools": {"decode": {"gpu": 1}}}, "additional properties 'gpu' not allowed"),
        ({"model": {"source": "s3"}}, "at '/model/source'"),
        ({"model": {"source": "pvc"}}, "at '/model/pvc/claimName': minLength"),
        (
            {"pools": {"decode": {"replicas": 9}}},
            "pools.decode: need minReplicas <= replicas <= maxReplicas, got 1 <= 9 <= 4",
        ),
        ({"pools": {"prefill": {"replicas": 0, "minReplicas": 0}}}, "pools.prefill.replicas must be at least 1"),
        ({"apiKey": {"value": "a", "existingSecret": "b"}}, "give existingSecret or value, not both"),
    ],
)
def test_invalid_values_fail_the_render_with_a_clear_message(values, message):
    errors = helm()
    with pytest.raises((errors.HelmValuesError, errors.HelmRenderError)) as caught:
        render(values)
    assert message in str(caught.value)


def test_a_broken_template_fails_the_render_and_the_real_chart_lints_clean(tmp_path):
    lib = helm()
    report = lib.lint(str(CHART), strict=True, kube_version="v1.33.0")
    assert report["errors"] == [] and all(m["severity"] < 2 for m in report["messages"]), report
    broken = tmp_path / "deepinfer"
    shutil.copytree(CHART, broken)
    (broken / "templates" / "broken.yaml").write_text("kind: {{ .Values.pools.decode.nope.deeper }}\n")
    with lib.Chart.load(str(broken)) as chart, pytest.raises(lib.HelmRenderError, match="broken.yaml"):
        chart.render(values={}, name="demo", namespace="inference")
    (broken / "templates" / "broken.yaml").write_text("kind: {{ if }}\n")
    with pytest.raises(lib.HelmError):
        with lib.Chart.load(str(broken)) as chart:
            chart.render(values={}, name="demo", namespace="inference")
