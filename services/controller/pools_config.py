"""The pools file: what the Helm chart tells the controller about each pool (`--pools-config`).

JSON, written by the chart's ConfigMap from its values (camelCase, as the values are):

    {"pools": {"decode": {"resource": "deepinfer_decode", "gpusPerEngine": 8, "expertParallelSize": 8,
                          "autoscaling": {"minReplicas": 1, "maxReplicas": 4, "targetRequests": 64}}},
     "planner": {"intervalSeconds": 5, "replaceDeadEngines": true,
                 "placementGraceSeconds": 30, "startTimeoutSeconds": 900}}

A pool's `expertParallelSize` makes each of its engines an instance of that many ranks (one actor
and `gpusPerEngine / expertParallelSize` GPUs each; `--decode-ep` / `--prefill-ep` on the command
line); replicas, bounds and targets then count instances. A pool's `autoscaling` block gives its policy's bounds and targets (`ScalingRule`); the policy runs
only when the head is told to autoscale. Unknown keys are refused: a typo must not pass silently.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from services.common.workers import POOL_NAMES
from services.controller.autoscale_policy import ScalingRule
from services.controller.placement import PoolPlacement

_POOLS_BY_NAME = {name: pool for pool, name in POOL_NAMES.items()}
_RULE_KEYS = {
    "minReplicas": "min_replicas",
    "maxReplicas": "max_replicas",
    "targetQueuedPromptTokens": "target_queued_prompt_tokens",
    "targetRequests": "target_requests",
    "targetKvUsage": "target_kv_usage",
    "tolerance": "tolerance",
    "scaleInBelow": "scale_in_below",
    "scaleOutCooldownSeconds": "scale_out_cooldown_s",
    "scaleInCooldownSeconds": "scale_in_cooldown_s",
    "scaleInStableSeconds": "scale_in_stable_s",
    "maxStep": "max_step",
}
_PLANNER_KEYS = {
    "intervalSeconds": "interval_s",
    "replaceDeadEngines": "replace_dead",
    "placementGraceSeconds": "placement_grace_s",
    "startTimeoutSeconds": "start_timeout_s",
}


@dataclass(frozen=True)
class PlannerSettings:
    interval_s: float = 5.0
    """How often the planner reads the pools' load and checks their engines."""
    replace_dead: bool = True
    """Start a new engine for one the router dropped (it stopped answering)."""
    placement_grace_s: float = 10.0
    start_timeout_s: float = 900.0


@dataclass(frozen=True)
class PoolsConfig:
    placements: dict[int, PoolPlacement] = field(default_factory=dict)
    rules: dict[int, ScalingRule] = field(default_factory=dict)
    """The autoscaling policy's bounds and targets, for the pools that have one."""
    planner: PlannerSettings = PlannerSettings()
    ep_sizes: dict[int, int] = field(default_factory=dict)
    """Ranks per engine instance of the pools that say so (1: single-process engines)."""


def load_pools_config(path: str) -> PoolsConfig:
    with open(path) as f:
        return parse_pools_config(json.load(f))


def parse_pools_config(doc: dict) -> PoolsConfig:
    _known(doc, {"pools", "planner"}, "the pools file")
    placements, rules, ep_sizes = {}, {}, {}
    for name, entry in doc.get("pools", {}).items():
        if name not in _POOLS_BY_NAME:
            raise ValueError(f"unknown pool {name!r} (known: {', '.join(_POOLS_BY_NAME)})")
        _known(entry, {"resource", "gpusPerEngine", "expertParallelSize", "autoscaling"}, f"pool {name}")
        pool = _POOLS_BY_NAME[name]
        placements[pool] = PoolPlacement(entry.get("resource", ""), entry.get("gpusPerEngine"))
        if "expertParallelSize" in entry:
            ep_sizes[pool] = _ep_size(name, entry["expertParallelSize"])
        if "autoscaling" in entry:
            rules[pool] = ScalingRule(**_renamed(entry["autoscaling"], _RULE_KEYS, f"pool {name} autoscaling"))
    planner = PlannerSettings(**_renamed(doc.get("planner", {}), _PLANNER_KEYS, "planner"))
    return PoolsConfig(placements, rules, planner, ep_sizes)


def _ep_size(pool: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"pool {pool}: expertParallelSize must be an integer >= 1, got {value!r}")
    if value > 1 and pool == "encoder":
        raise ValueError("pool encoder: vision encoders have no experts to shard (expertParallelSize must be 1)")
    return value


def _renamed(entry: dict, keys: dict[str, str], where: str) -> dict:
    _known(entry, set(keys), where)
    return {keys[k]: v for k, v in entry.items()}


def _known(entry: dict, allowed: set[str], where: str) -> None:
    unknown = sorted(set(entry) - allowed)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(allowed))})")


def with_placements(spec, config: PoolsConfig):
    """The controller's `PoolSpec` with the file's placements, instance sizes (they win over the
    command line's) and clocks."""
    ep_sizes = {pool: n for pool, n in {**spec.ep_sizes, **config.ep_sizes}.items() if n > 1}
    return dataclasses.replace(
        spec,
        placements={**spec.placements, **config.placements},
        ep_sizes=ep_sizes,
        placement_grace_s=config.planner.placement_grace_s,
        start_timeout_s=config.planner.start_timeout_s,
    )
