"""EPLB across real processes (gloo, four ranks): rearranged expert weights land on the right
slots of every rank, greedy outputs do not change when experts move mid-generation, and a NORMAL
instance rearranges only on the steps its role allows (never on a prefill step nor right after)."""

import pytest
import torch

from deepinfer_core.config import EplbConfig
from deepinfer_core.distributed.placement import ExpertPlacement, imbalance
from deepinfer_core.eplb.policy import rebalance
from deepinfer_core.eplb.rearrange import move_experts
from deepinfer_core.models.layers.moe import FusedExperts
from tests.helpers.engines import greedy, make_engine, run_to_completion
from tests.helpers.ep import drive, make_rank_engine, run_ranks

E, REDUNDANT, LAYERS = 8, 4, 2
SKEWED = torch.tensor([[900, 10, 10, 10, 400, 10, 10, 10], [5, 5, 5, 5, 5, 5, 300, 700]])
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26], [30, 31, 32, 33]]
MAX_NEW = 12


def _fake_experts(placement: ExpertPlacement, rank: int) -> list[FusedExperts]:
    """Each slot's tensors filled with its logical expert id (w13, w2: H=4, I=2)."""
    layers = []
    for layer in range(placement.num_layers):
        slots = placement.local_experts(layer, rank)
        m = FusedExperts(E, 4, 2, torch.float32, local_experts=slots)
        with torch.no_grad():
            for i, e in enumerate(slots):
                m.w13_weight[i].fill_(e)
                m.w2_weight[i].fill_(e + 0.5)
        layers.append(m)
    return layers


def _moved_weights(group) -> dict:
    """Rearrange fake experts to the global policy's placement for SKEWED; each slot's content."""
    placement = ExpertPlacement.contiguous(LAYERS, E, group.size, REDUNDANT)
    experts = _fake_experts(placement, group.rank)
    new = rebalance(SKEWED, E + REDUNDANT, group.size, "global")
    moved = move_experts(experts, placement.phy2log, new, group)
    return {
        "new": new.tolist(),
        "received": moved["received"],
        "w13": [[float(m.w13_weight[i].unique().item()) for i in range(len(m.local_experts))] for m in experts],
        "w2": [[float(m.w2_weight[i].unique().item()) for i in range(len(m.local_experts))] for m in experts],
        "local": [list(m.local_experts) for m in experts],
    }


def _serving(group) -> dict:
    """A NORMAL EP=4 instance with EPLB every 3 counted steps, redundant slots, mid-generation."""
    eplb = EplbConfig(enabled=True, num_redundant_experts=REDUNDANT, rearrange_interval=3, measure_interval=1)
    engine = make_rank_engine(group, eplb=eplb)
    trace = []  # (prompt_run, rearrangements so far) per step
    engine.post_schedule = lambda out: trace.append((out.prompt_run, engine.balancer.num_rearrangements))
    from deepinfer_core.distributed.lockstep import LockstepRank

    lock = LockstepRank(engine, group)
    engine.add_request("a", params=greedy(MAX_NEW), prompt_token_ids=PROMPTS[group.rank])
    for _ in range(4):
        lock.step()
    engine.add_request("b", params=greedy(MAX_NEW), prompt_token_ids=PROMPTS[3 - group.rank])  # a later prefill
    tokens = drive(lock, engine)
    lock.close()
    return {"tokens": tokens, "trace": trace, "imbalance": engine.balancer.imbalance,
            "local": [list(m.local_experts) for m in engine.worker.ep.experts]}  # fmt: skip


def _ranks_main(group) -> dict:
    return {"moved": _moved_weights(group), "serving": _serving(group)}


@pytest.fixture(scope="module")
def ranks():
    res = run_ranks(4, _ranks_main, (), timeout_s=540)
    assert sorted(res) == [0, 1, 2, 3] and not any(isinstance(r, str) for r in res.values()), res
    return res


@pytest.mark.timeout(600)
def test_every_physical_slot_holds_its_expert_after_a_rearrangement(ranks):
    new = ranks[0]["moved"]["new"]
    S = (E + REDUNDANT) // 4
    for rank, res in ranks.items():
        moved = res["moved"]
        for layer in range(LAYERS):
            expected = new[layer][rank * S : (rank + 1) * S]
            assert moved["local"][layer] == expected
            assert moved["w13"][layer] == [float(e) for e in expected]
            assert moved["w2"][layer] == [e + 0.5 for e in expected]
    assert sum(r["moved"]["received"] for r in ranks.values()) > 0


def test_the_new_placement_lowers_the_imbalance_of_the_skewed_load():
    before = imbalance(ExpertPlacement.contiguous(LAYERS, E, 4, REDUNDANT).rank_load(SKEWED))
    after = imbalance(ExpertPlacement(rebalance(SKEWED, E + REDUNDANT, 4, "global"), E, 4).rank_load(SKEWED))
    assert after < before - 0.3


def _reference() -> dict:
    engine = make_engine(dtype="float32", num_gpu_blocks=128)
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), params=greedy(MAX_NEW), prompt_token_ids=p)
    done = run_to_completion(engine)
    return {i: list(done[str(i)].outputs[0].token_ids) for i in range(len(PROMPTS))}


def test_greedy_outputs_are_unchanged_by_rearrangements(ranks):
    ref = _reference()
    for rank, res in ranks.items():
        assert res["serving"]["tokens"] == {"a": ref[rank], "b": ref[3 - rank]}
        assert res["serving"]["trace"][-1][1] >= 2, "experts were rearranged more than once"
        assert res["serving"]["imbalance"] is not None
    initial = ExpertPlacement.contiguous(LAYERS, E, 4, REDUNDANT)
    moved = [r["serving"]["local"] != [initial.local_experts(layer, rank) for layer in range(LAYERS)]
             for rank, r in ranks.items()]  # fmt: skip
    assert any(moved), "the served experts moved away from the initial placement"


def test_a_normal_instance_rearranges_only_on_a_decode_step_after_a_decode_step(ranks):
    for res in ranks.values():
        trace = res["serving"]["trace"]
        steps = [i for i in range(1, len(trace)) if trace[i][1] > trace[i - 1][1]]
        assert steps
        for i in steps:
            assert trace[i][0] is False and trace[i - 1][0] is False, (i, trace)
        assert any(kind for kind, _ in trace[5:]), "a prefill step came between rearrangements"
