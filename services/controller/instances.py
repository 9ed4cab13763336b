"""Starting an expert-parallel engine instance: N rank actors placed together, started together.

An instance of N ranks is N worker actors (one per device, or per CPU process) in one Ray
placement group (PACK: on as few nodes as fit), taking one unit of its pool's custom resource in
all (a share per rank). Rank 0 picks the rendezvous address on its node;
every rank then joins the instance's `torch.distributed` group while building its engine, and
registers with the router as a worker of its own (`<instance>.<rank>`): each rank is a decode (or
prefill) target scored by its own load, and the KV target a CE rank hands out names that rank's
own KV agent. If any rank fails or misses the start deadline, every actor and the placement group
are removed (no orphans) and the error names the failure (a rank that never joined is named by
its peers).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from services.common.errors import ErrorCode, ServiceError
from services.workers.spec import InstanceRank, WorkerSpec

logger = logging.getLogger(__name__)


@dataclass
class Instance:
    """The Ray side of a running instance."""

    ranks: list[tuple[str, Any]] = field(default_factory=list)
    """(worker id, actor handle) per rank."""
    placement_group: Any = None

    def kill(self) -> None:
        import ray

        for _, handle in self.ranks:
            try:
                ray.kill(handle)
            except Exception:  # already gone
                pass
        if self.placement_group is not None:
            try:
                ray.util.remove_placement_group(self.placement_group)
            except Exception:
                pass


def _resource_share(size: int) -> float:
    """Each rank's share of its pool's custom resource: the chart's worker groups offer one unit per
    engine, and an instance is one engine, whatever its size (rounded down to Ray's precision)."""
    return int(10_000 / size) / 10_000


def _bundle(gpus: float, resource: str, size: int) -> dict:
    bundle: dict = {"CPU": 0.01}  # Ray refuses empty bundles; the engines take no CPU reservation
    if gpus:
        bundle["GPU"] = gpus
    if resource:
        bundle[resource] = _resource_share(size)
    return bundle


async def start_instance(instance_id: str, size: int, make_spec: Callable[[str], WorkerSpec], gpus: float,
                         resource: str, timeout_s: float, join_timeout_s: float) -> Instance:  # fmt: skip
    """Place, start and register the `size` ranks of one instance.

    Raises:
        ServiceError: the placement or any rank failed, or the start passed `timeout_s`.
    """
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from services.controller.node_worker_actor import NodeWorkerActor

    instance = Instance()
    try:
        pg = ray.util.placement_group([_bundle(gpus, resource, size)] * size, strategy="PACK", name=instance_id)
        instance.placement_group = pg
        await asyncio.wait_for(pg.ready(), timeout_s)
        for rank in range(size):
            worker_id = f"{instance_id}.{rank}"
            options = dict(num_cpus=0.01, num_gpus=gpus, resources={resource: _resource_share(size)} if resource else {},
                           scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank))  # fmt: skip
            handle = ray.remote(NodeWorkerActor).options(name=worker_id, max_concurrency=4, **options)
            instance.ranks.append((worker_id, handle.remote(make_spec(worker_id))))
        address = await asyncio.wait_for(instance.ranks[0][1].rendezvous_address.remote(), timeout_s)
        starts = [_await(h.start.remote(InstanceRank(r, size, address, join_timeout_s)))
                  for r, (_, h) in enumerate(instance.ranks)]  # fmt: skip
        results = await asyncio.wait_for(asyncio.gather(*starts, return_exceptions=True), timeout_s)
        failed = [f"rank {r}: {_why(e)}" for r, e in enumerate(results) if isinstance(e, BaseException)]
        if failed:
            raise RuntimeError("; ".join(failed))
    except BaseException as e:
        instance.kill()
        why = "it did not start in time" if isinstance(e, asyncio.TimeoutError) else str(e)
        raise ServiceError(ErrorCode.INTERNAL, f"instance {instance_id} of {size} ranks failed to start: {why}") from e
    logger.info("started instance %s: %d ranks", instance_id, size)
    return instance


async def _await(ref):
    return await ref


def _why(e: BaseException) -> str:
    """A rank's own last words, from inside Ray's wrapping of its exception."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    for line in lines:
        if "did not join the instance" in line:
            return line
    return lines[-1] if lines else type(e).__name__
