"""Starting an expert-parallel instance on Ray: a rank that fails before joining fails the whole
start with a message naming it (its peer waited for it until the join timeout), and leaves no
actor and no placement group behind. The instance takes one unit of its pool's custom resource in
all (what the chart's worker groups offer per engine), shared among its ranks."""

import asyncio
import dataclasses
import os

import pytest

from services.common.errors import ServiceError
from services.common.workers import POOL_DECODE
from services.controller.instances import start_instance
from services.workers.spec import EngineSettings, WorkerSpec
from tests.helpers.cluster import wait_until

ENGINE = EngineSettings(device="cpu", num_gpu_blocks=64, max_model_len=160, block_size=8, max_num_seqs=8)


@pytest.fixture(scope="module")
def ray_local():
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    # "local": a cluster of its own, even where another Ray runs on this machine
    ray.init(address="local", num_cpus=1, resources={"deepinfer_decode": 1}, include_dashboard=False,
             logging_level="WARNING", log_to_driver=False)  # fmt: skip
    yield ray
    ray.shutdown()


def _spec(worker_id: str) -> WorkerSpec:
    engine = ENGINE if worker_id.endswith(".0") else dataclasses.replace(ENGINE, device="bogus")  # rank 1 fails
    return WorkerSpec(worker_id=worker_id, pool=POOL_DECODE, engine_args=engine, metrics=False)


@pytest.mark.timeout(300)
def test_a_rank_that_fails_before_joining_fails_the_instance_naming_it(ray_local):
    with pytest.raises(ServiceError) as err:
        # one unit for two ranks: placed only because each rank's bundle asks for half of it
        asyncio.run(start_instance("decode-7", 2, _spec, 0.0, "deepinfer_decode", timeout_s=120, join_timeout_s=5.0))
    message = str(err.value)
    assert "instance decode-7 of 2 ranks failed to start" in message
    assert "rank 1: " in message and "bogus" in message, message
    assert "rank 0: " in message and "rank(s) [1] of 2 did not join" in message, message
    from ray.util import placement_group_table

    assert not [a for a in ray_local.util.list_named_actors() if a.startswith("decode-7")]
    assert all(pg["state"] == "REMOVED" for pg in placement_group_table().values() if pg["name"] == "decode-7")
    assert wait_until(lambda: ray_local.available_resources().get("deepinfer_decode") == 1, timeout_s=30)
