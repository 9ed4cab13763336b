"""The pools file the chart writes: placements and policy bounds per pool; typos are refused."""

import pytest

from services.common.workers import POOL_DECODE, POOL_PREFILL
from services.controller.controller import PoolSpec
from services.controller.placement import PoolPlacement, default_resource, unplaceable_reason
from services.controller.pools_config import parse_pools_config, with_placements

DOC = {
    "pools": {
        "prefill": {"resource": "deepinfer_prefill", "gpusPerEngine": 1},
        "decode": {
            "resource": "deepinfer_decode",
            "gpusPerEngine": 8,
            "autoscaling": {"minReplicas": 1, "maxReplicas": 6, "targetRequests": 32, "scaleInCooldownSeconds": 300},
        },
    },
    "planner": {"intervalSeconds": 2, "placementGraceSeconds": 30, "startTimeoutSeconds": 1200},
}


def test_the_chart_s_pools_file_becomes_placements_rules_and_clocks():
    config = parse_pools_config(DOC)
    assert config.placements[POOL_DECODE] == PoolPlacement("deepinfer_decode", 8)
    assert set(config.rules) == {POOL_DECODE}
    rule = config.rules[POOL_DECODE]
    assert (rule.min_replicas, rule.max_replicas, rule.target_requests, rule.scale_in_cooldown_s) == (1, 6, 32, 300)
    assert config.planner.interval_s == 2 and config.planner.replace_dead
    spec = with_placements(PoolSpec(gpus_per_worker=1), config)
    assert spec.placement_grace_s == 30 and spec.start_timeout_s == 1200
    assert spec.placements[POOL_PREFILL].actor_options(spec.gpus_per_worker) == {
        "num_cpus": 0,
        "num_gpus": 1,
        "resources": {"deepinfer_prefill": 1},
    }
    assert default_resource(POOL_DECODE) == "deepinfer_decode"


@pytest.mark.parametrize(
    "doc, message",
    [
        ({"pools": {"vision": {}}}, "unknown pool 'vision'"),
        ({"pools": {"decode": {"gpus": 8}}}, "unknown key(s) gpus"),
        ({"pools": {"decode": {"autoscaling": {"maxReplica": 3}}}}, "unknown key(s) maxReplica"),
        ({"pools": {"decode": {"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}}}, "min_replicas <= max_replicas"),
        ({"planer": {}}, "unknown key(s) planer"),
    ],
)
def test_a_wrong_pools_file_is_refused_with_a_clear_message(doc, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_pools_config(doc)


def test_an_engine_without_a_node_is_explained():
    placement = PoolPlacement("deepinfer_decode", 8)
    nodes = [{"Alive": True, "Resources": {"CPU": 4.0, "deepinfer_prefill": 1.0}}]
    reason = unplaceable_reason(POOL_DECODE, placement, 31, nodes)
    assert "decode pool" in reason and "no node offers Ray resource 'deepinfer_decode'" in reason
    nodes.append({"Alive": True, "Resources": {"deepinfer_decode": 1.0}})
    assert "every node offering 'deepinfer_decode' (1) is full" in unplaceable_reason(POOL_DECODE, placement, 31, nodes)


def test_an_engine_any_live_node_can_host_is_not_reported_as_unplaced():
    """No GPU and no custom resource: a slow start on a busy machine is not a placement problem."""
    nodes = [{"Alive": True, "Resources": {"CPU": 2.0}}]
    assert unplaceable_reason(POOL_DECODE, PoolPlacement(), 31, nodes) is None
    reason = unplaceable_reason(POOL_DECODE, PoolPlacement(gpus=1), 31, nodes)
    assert "for a node with 1 free GPU(s)" in reason


def test_a_pool_s_expert_parallel_size_makes_its_engines_instances_and_wins_over_the_flag():
    doc = {"pools": {"decode": {"gpusPerEngine": 8, "expertParallelSize": 8}, "prefill": {"expertParallelSize": 1}}}
    config = parse_pools_config(doc)
    assert config.ep_sizes == {POOL_DECODE: 8, POOL_PREFILL: 1}
    spec = with_placements(PoolSpec(ep_sizes={POOL_DECODE: 2, POOL_PREFILL: 4}), config)
    assert spec.ep_sizes == {POOL_DECODE: 8}  # the file's 1 makes prefill engines single processes
    assert with_placements(PoolSpec(ep_sizes={POOL_DECODE: 2}), parse_pools_config({})).ep_sizes == {POOL_DECODE: 2}


@pytest.mark.parametrize("value", [0, -2, "2", 2.0, True])
def test_an_expert_parallel_size_that_is_not_a_positive_integer_is_refused(value):
    with pytest.raises(ValueError, match=r"pool decode: expertParallelSize must be an integer >= 1"):
        parse_pools_config({"pools": {"decode": {"expertParallelSize": value}}})


def test_an_encoder_pool_cannot_be_expert_parallel():
    with pytest.raises(ValueError, match="vision encoders have no experts to shard"):
        parse_pools_config({"pools": {"encoder": {"expertParallelSize": 2}}})


def test_serve_checks_the_file_s_sizes_against_the_model_before_anything_starts(tmp_path):
    """The embedded model has 8 routed experts: 3 ranks cannot share them."""
    import json

    from services.controller.serve_config import HeadConfig

    path = tmp_path / "pools.json"
    path.write_text(json.dumps({"pools": {"decode": {"expertParallelSize": 3}}}))
    with pytest.raises(ValueError, match=r"pools.json: pool decode expertParallelSize 3: .*must divide the 8"):
        HeadConfig(pools_config=str(path)).check_expert_parallel()
    path.write_text(json.dumps({"pools": {"decode": {"expertParallelSize": 4}}}))
    HeadConfig(pools_config=str(path)).check_expert_parallel()
