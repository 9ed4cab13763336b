"""A pool of expert-parallel instances is counted in instances, as its target is: `deepinfer
status` names instances and their ranks, and the autoscaling policy's engine is the instance
(its ranks' KV caches together), not each rank."""

from deepinfer_proto import common_pb2
from services.cli import admin
from services.common.workers import POOL_DECODE, POOL_PREFILL, WorkerInfo, WorkerLoad
from services.controller.planner import registry_signals
from services.router.registry import PoolRegistry, WorkerHandle
from services.router.service import cluster_status


def _registry(worker_ids: dict[str, int], kv_usage: float = 0.5) -> PoolRegistry:
    registry = PoolRegistry(client_factory=lambda info: None)
    for worker_id, pool in worker_ids.items():
        info = WorkerInfo(worker_id, pool, 0, "127.0.0.1:1")
        registry.workers[worker_id] = WorkerHandle(info, None, load=WorkerLoad(kv_usage=kv_usage, running_requests=1))
    return registry


class _Core:
    """What `cluster_status` reads of the router: its registry, model and readiness."""

    def __init__(self, registry: PoolRegistry):
        self.registry, self.model = registry, "m"

    def ready(self):
        return True, "ok"


def test_status_counts_instances_against_the_target_and_names_one_missing_a_rank():
    registry = _registry(
        {"decode-0.0": POOL_DECODE, "decode-0.1": POOL_DECODE, "decode-3.1": POOL_DECODE, "prefill-1": POOL_PREFILL}
    )
    status = cluster_status(_Core(registry), {POOL_DECODE: 2, POOL_PREFILL: 1}, {POOL_DECODE: 2})
    text = admin.format_status(status)
    assert "decode pool: 2 instance(s) of 2 ranks (3 rank workers), target 2; decode-3 has 1 of 2 ranks" in text
    assert "prefill pool: 1 worker(s), target 1" in text  # single-process engines: as before
    decode = next(p for p in status.pools if p.pool == POOL_DECODE)
    assert decode.ranks_per_instance == 2 and len(decode.workers) == 3


def test_a_status_without_ep_sizes_counts_workers():
    status = cluster_status(_Core(_registry({"decode-0": POOL_DECODE})), {POOL_DECODE: 1})
    assert "decode pool: 1 worker(s), target 1" in admin.format_status(status)
    assert common_pb2.PoolStatus().ranks_per_instance == 0  # an older head's status reads as one process each


def test_the_policy_s_engine_is_the_instance():
    registry = _registry({f"decode-{i}.{r}": POOL_DECODE for i in range(2) for r in range(4)}, kv_usage=0.5)
    ep = registry_signals(registry, {POOL_DECODE: 4})(POOL_DECODE)
    assert ep.engines == 2 and ep.kv_used == 1.0  # two instances, each half full
    assert ep.running_requests == 8  # requests are requests, wherever they run
    flat = registry_signals(registry)(POOL_DECODE)
    assert flat.engines == 8 and flat.kv_used == 4.0
