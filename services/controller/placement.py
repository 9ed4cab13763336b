"""Where a pool's engines may run: the Ray resources each engine asks for, and why one waits.

In the Helm chart every worker group's Ray nodes offer a custom resource of their own
(`deepinfer_prefill`, `deepinfer_decode`, ...), as many units as engines fit on one of its pods.
An engine that asks for one unit can only land on a node of its group, and an engine that cannot be
placed is the demand Ray's autoscaler answers with a new pod of that group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from services.common.workers import POOL_NAMES


def default_resource(pool: int) -> str:
    """The custom Ray resource the chart gives the worker group of `pool`."""
    return f"deepinfer_{POOL_NAMES[pool]}"


@dataclass(frozen=True)
class PoolPlacement:
    """What one engine of a pool asks Ray for."""

    resource: str = ""
    """Custom Ray resource, one unit per engine ("" = none: any node with the GPUs will do)."""
    gpus: Optional[float] = None
    """GPUs per engine (its expert-parallel ranks); None = the cluster's `gpus_per_worker`."""

    def actor_options(self, default_gpus: float) -> dict[str, Any]:
        """`ray.remote(...).options(**these)` for one engine actor."""
        options: dict[str, Any] = {"num_cpus": 0, "num_gpus": default_gpus if self.gpus is None else self.gpus}
        if self.resource:
            options["resources"] = {self.resource: 1}
        return options


def unplaceable_reason(pool: int, placement: PoolPlacement, waited_s: float, nodes: list[dict]) -> Optional[str]:
    """Why an engine of `pool` has waited `waited_s` for a node, as the operator should read it;
    None when any live node can take it (it is placed and still starting, e.g. on a busy machine).

    `nodes`: `ray.nodes()`, each with `Alive` and `Resources` (the node's totals)."""
    name = POOL_NAMES[pool]
    alive = [n for n in nodes if n.get("Alive")]
    if placement.resource:
        offering = [n for n in alive if n.get("Resources", {}).get(placement.resource, 0) > 0]
        if not offering:
            return (
                f"{name} pool: an engine has waited {waited_s:.0f}s: no node offers Ray resource "
                f"{placement.resource!r} (its worker group has no pod yet; Ray's autoscaler adds one if the "
                "group's maxReplicas allows and a Kubernetes node can take it)"
            )
        return (
            f"{name} pool: an engine has waited {waited_s:.0f}s: every node offering {placement.resource!r} "
            f"({len(offering)}) is full"
        )
    gpus = placement.gpus or 0
    if not gpus and alive:
        return None  # no GPU, no custom resource: every live node can host it
    return f"{name} pool: an engine has waited {waited_s:.0f}s for a node with {gpus:g} free GPU(s)"
