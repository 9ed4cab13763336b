"""The rebalancing policies and the transfer plan, on synthetic loads (no processes)."""

import pytest
import torch

from deepinfer_core.distributed.placement import ExpertPlacement, imbalance
from deepinfer_core.eplb.policy import balanced_packing, rebalance, replicate
from deepinfer_core.eplb.rearrange import plan_layer

E, N = 8, 4
SKEWED = torch.tensor([[900.0, 10, 10, 10, 400, 10, 10, 10], [5, 5, 5, 5, 5, 5, 300, 700]])


def test_replicate_gives_every_expert_a_slot_and_hot_ones_the_spares():
    # spares go by load per replica: 100 -> 0; 50 vs 50 -> 0 (lower id); 33 vs 50 -> 3
    assert replicate([100, 1, 1, 50], 7) == [0, 0, 0, 1, 2, 3, 3]


def test_balanced_packing_fills_every_pack_equally():
    packs = balanced_packing([9, 1, 8, 2, 7, 3], 3)
    assert [len(p) for p in packs] == [2, 2, 2]
    assert sorted(sum(([9, 1, 8, 2, 7, 3][i] for i in p), 0) for p in packs) == [10, 10, 10]


@pytest.mark.parametrize("policy", ["global", "hierarchical"])
@pytest.mark.parametrize("redundant", [0, 4])
def test_placements_are_valid(policy, redundant):
    phy2log = rebalance(SKEWED, E + redundant, N, policy, num_groups=4, num_nodes=2)
    placement = ExpertPlacement(phy2log, E, N)  # refresh() insists every expert is held
    assert phy2log.shape == (2, E + redundant)
    assert int(placement.logcnt.sum(1).min()) == E + redundant


@pytest.mark.parametrize("policy", ["global", "hierarchical"])
def test_imbalance_drops_on_a_skewed_load(policy):
    before = imbalance(ExpertPlacement.contiguous(2, E, N, 4).rank_load(SKEWED))
    after = imbalance(ExpertPlacement(rebalance(SKEWED, E + 4, N, policy, 4, 2), E, N).rank_load(SKEWED))
    assert after < before - 0.3, (before, after)


def test_hierarchical_keeps_each_expert_group_on_one_node():
    phy2log = rebalance(SKEWED, E + 4, N, "hierarchical", num_groups=4, num_nodes=2)
    for row in phy2log.tolist():
        half = len(row) // 2
        nodes_of_group = [{n for n in (0, 1) if any(e // 2 == g for e in row[n * half : (n + 1) * half])}
                          for g in range(4)]  # fmt: skip
        assert all(len(n) == 1 for n in nodes_of_group), row


def test_plan_moves_only_what_the_destination_lacks_from_the_lowest_holder():
    old = [0, 1, 2, 3, 0, 1]  # 3 ranks x 2 slots
    new = [0, 0, 3, 2, 1, 1]
    # rank 0 keeps 0 (copies it locally twice); rank 1 has 2, 3 already; rank 2 has 1 locally
    assert plan_layer(old, new, 3) == []
    assert plan_layer([0, 1, 2, 3], [3, 2, 1, 0], 2) == [(1, 0, 0), (1, 0, 1), (0, 1, 0), (0, 1, 1)]
