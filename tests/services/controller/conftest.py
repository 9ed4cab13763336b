"""A local multi-node Ray cluster standing in for the chart's worker groups: one node per group,
each offering its group's custom resource, the router and the gateway of a front-only head, and a
controller placing engines by those resources. Small and bounded: the embedded tiny model, engines
that take no CPU reservation, one asyncio loop on a thread of its own that the tests submit to."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from services.common.workers import POOL_DECODE, POOL_ENCODER, POOL_PREFILL
from services.controller.placement import PoolPlacement, default_resource
from services.workers.spec import EngineSettings

ENGINE = EngineSettings(device="cpu", num_gpu_blocks=128, max_model_len=160, block_size=8, max_num_seqs=16)


class Groups:
    """The Ray cluster (`nodes`: pool -> its node), the head's front door and the controller."""

    def __init__(self):
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        # every node, driver and worker on the loopback address: Ray otherwise resolves 127.0.0.1 to the
        # machine's own address when a driver connects (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` stops that;
        # the raylets and their workers inherit it, this process may have read the flag already)
        self._saved_flag = os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        import ray
        from ray._private import ray_constants
        from ray.cluster_utils import Cluster

        ray_constants.ENABLE_RAY_CLUSTER = False
        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 1, "include_dashboard": False, "node_ip_address": "127.0.0.1"},
        )
        self.nodes = {
            pool: self.cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1", resources={default_resource(pool): 2})
            for pool in (POOL_ENCODER, POOL_PREFILL, POOL_DECODE)
        }
        ray.init(address=self.cluster.address, logging_level="WARNING", log_to_driver=False)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="controller-loop", daemon=True)
        self._thread.start()
        self.head = None
        self.controller = None
        self.run(self._start_head())

    async def _start_head(self) -> None:
        from services.controller.controller import ClusterController, PoolSpec
        from services.controller.head import Head
        from services.controller.serve_config import HeadConfig

        self.head = Head(HeadConfig(port=0, grpc_port=0, engine_args=ENGINE))
        await self.head.start_front()
        placements = {pool: PoolPlacement(default_resource(pool)) for pool in (POOL_PREFILL, POOL_DECODE)}
        spec = PoolSpec(
            ENGINE,
            self.head.config.model_name,
            host="",
            placements=placements,
            placement_grace_s=1.0,
            cluster_token=self.head.config.cluster_token,
        )
        self.controller = ClusterController(spec, self.head.router, self.head.router_address)
        self.head.cluster_service.controller = self.controller

    def run(self, coro, timeout_s: float = 300.0):
        """Run `coro` on the controller's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def submit(self, coro):
        """Start `coro` on the controller's loop; a concurrent future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def ready_sizes(self) -> dict[int, int]:
        """Ready workers per pool in the router's registry."""
        registry = self.head.router.registry
        return {pool: len(registry.pool(pool)) for pool in (POOL_PREFILL, POOL_DECODE)}

    def node_of(self, worker_id: str) -> str:
        import ray

        return ray.get(self.controller.actors[worker_id].handle.node_id.remote(), timeout=60)

    def close(self) -> None:
        import ray

        try:
            self.run(self.controller.shutdown(), 60)
            self.run(self.head.stop(), 60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            ray.shutdown()
            self.cluster.shutdown()
            self._restore_flag()

    def _restore_flag(self) -> None:
        from ray._private import ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = True
        if self._saved_flag is None:
            os.environ.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
        else:
            os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = self._saved_flag


@pytest.fixture(scope="package")
def groups():
    from tests.helpers.nixl import require_nixl

    require_nixl()
    g = Groups()
    yield g
    g.close()
