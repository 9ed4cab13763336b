"""Rebalancing policies: per-expert load [L, E] -> a placement `phy2log` [L, P] over N ranks.

In the spirit of DeepSeek's EPLB (`deepseek-ai/EPLB`), written from its description:

    replicate   each logical expert gets one slot; every redundant slot goes, one at a time, to
                the expert with the largest load per replica (its load splits evenly over replicas)
    pack        slots (weight = load / replicas) onto ranks, S slots each: heaviest first, each to
                the lightest rank that still has room (greedy balanced packing)

`global` replicates and packs over all ranks at once (decode: large EP, no node structure to
respect). `hierarchical` first packs the routing's expert groups onto nodes (group-limited routing
then keeps a token's traffic inside few nodes), then replicates and packs inside each node
(prefill: smaller EP spanning few nodes). Where groups do not split over nodes it falls back to
`global`. Every rank computes the same placement from the same all-reduced load: ties break
by index, nothing is random.
"""

from __future__ import annotations

import torch


def replicate(load: list[float], num_slots: int) -> list[int]:
    """Logical expert of each slot: every expert once, then the redundant slots to the experts with
    the most load per replica. Slots of one expert are adjacent, experts in id order."""
    counts = [1] * len(load)
    for _ in range(num_slots - len(load)):
        hot = max(range(len(load)), key=lambda e: (load[e] / counts[e], -e))
        counts[hot] += 1
    return [e for e, c in enumerate(counts) for _ in range(c)]


def balanced_packing(weights: list[float], num_packs: int) -> list[list[int]]:
    """Items (indices of `weights`) into `num_packs` packs of equal item count, heaviest item first
    into the lightest pack with room. Each pack's items in index order."""
    per_pack = len(weights) // num_packs
    packs: list[list[int]] = [[] for _ in range(num_packs)]
    totals = [0.0] * num_packs
    for item in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        pack = min((p for p in range(num_packs) if len(packs[p]) < per_pack), key=lambda p: (totals[p], p))
        packs[pack].append(item)
        totals[pack] += weights[item]
    return [sorted(p) for p in packs]


def _place(load: list[float], experts: list[int], num_slots: int, num_ranks: int) -> list[int]:
    """Replicate `experts` (logical ids; `load` indexed by id) into `num_slots` slots and pack them
    onto `num_ranks` ranks; the slots' logical ids, rank after rank."""
    local = replicate([load[e] for e in experts], num_slots)  # index into `experts`
    counts = [local.count(i) for i in range(len(experts))]
    weights = [load[experts[i]] / counts[i] for i in local]
    return [experts[local[slot]] for pack in balanced_packing(weights, num_ranks) for slot in pack]


def rebalance_global(load: list[float], num_slots: int, num_ranks: int) -> list[int]:
    return _place(load, list(range(len(load))), num_slots, num_ranks)


def rebalance_hierarchical(load: list[float], num_slots: int, num_ranks: int, num_groups: int,
                           num_nodes: int) -> list[int]:  # fmt: skip
    """Groups onto nodes, then replicas and packing inside each node."""
    E = len(load)
    if num_nodes < 1 or E % num_groups or num_groups % num_nodes or num_ranks % num_nodes or num_slots % num_nodes:
        return rebalance_global(load, num_slots, num_ranks)
    size = E // num_groups
    group_load = [sum(load[g * size : (g + 1) * size]) for g in range(num_groups)]
    placement: list[int] = []
    for groups in balanced_packing(group_load, num_nodes):
        experts = [g * size + i for g in groups for i in range(size)]
        placement += _place(load, experts, num_slots // num_nodes, num_ranks // num_nodes)
    return placement


def rebalance(load: torch.Tensor, num_slots: int, num_ranks: int, policy: str, num_groups: int = 1,
              num_nodes: int = 1) -> torch.Tensor:  # fmt: skip
    """[L, E] load -> [L, P] int64 phy2log, one layer at a time."""
    rows = []
    for layer_load in load.double().tolist():
        if policy == "hierarchical":
            rows.append(rebalance_hierarchical(layer_load, num_slots, num_ranks, num_groups, num_nodes))
        elif policy == "global":
            rows.append(rebalance_global(layer_load, num_slots, num_ranks))
        else:
            raise ValueError(f"unknown EPLB policy {policy!r}")
    return torch.tensor(rows, dtype=torch.int64)
