"""What a captured expert-parallel decode graph needs, checked on CPU (gloo, real processes).

A CUDA graph replays the addresses it captured, so everything an EP decode step reads or writes
must keep its storage: the per-expert load counter (added to in place, read and zeroed between
steps), the placement's maps (rewritten in place by a rearrangement) and the expert weights
(moved slot by slot into the same parameters). Here an EP=2 instance on the padded dispatch
serves prompts through several EPLB rearrangements while every step checks those addresses, and
its tokens equal a single process's; one-rank instances take the same path; ranks proposing
different graph batch sizes all capture the common ones; the runner captures only where the
dispatch allows it.
"""

import copy
import dataclasses

import pytest
import torch

from deepinfer_core.config import EplbConfig
from deepinfer_core.distributed.dispatch import AllToAllDispatcher
from deepinfer_core.distributed.expert_parallel import NO_ROW_LIMIT
from deepinfer_core.distributed.group import InstanceGroup
from deepinfer_core.distributed.placement import ExpertPlacement
from deepinfer_core.eplb.policy import rebalance
from deepinfer_core.models.layers import moe
from deepinfer_core.roles import EngineType
from deepinfer_core.worker.cuda_graph import shared_buckets
from deepinfer_core.worker.model_runner import ModelRunner
from tests.helpers.engines import greedy, make_engine, run_to_completion
from tests.helpers.ep import RANK_ERROR, drive, make_rank_engine, run_ranks

E, REDUNDANT = 8, 4
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26], [30, 31, 32, 33]]
MAX_NEW = 10
EPLB = EplbConfig(enabled=True, num_redundant_experts=REDUNDANT, rearrange_interval=3, measure_interval=1)


def _addresses(engine) -> dict:
    """Storage of every tensor a captured decode step reads or writes."""
    ep = engine.worker.ep
    p = ep.placement
    dev_logcnt, dev_log2phy = p.place_on(ep.load.device)
    return {
        "load": ep.load.data_ptr(),
        "num_real": ep.num_real.data_ptr(),
        "maps": [t.data_ptr() for t in (p.phy2log, p.logcnt, p.log2phy, dev_logcnt, dev_log2phy)],
        "weights": [t.data_ptr() for m in ep.experts for _, t in m.named_parameters(recurse=False)],
        "rows": [b.ep.load.data_ptr() for b in ep.blocks],  # each layer's row of `load`
    }


def _count_real_rows_only(engine) -> dict:
    """One MoE layer over 3 tokens with only the first counted (a graph's padding rows); every rank
    calls it (the padded dispatch's collectives)."""
    ep = engine.worker.ep
    block = ep.blocks[0]
    ep.take_load()
    ep.num_real.fill_(1)
    with torch.inference_mode():
        block(torch.randn(3, block.gate.weight.shape[1]))
    ep.num_real.fill_(NO_ROW_LIMIT)
    load = ep.take_load()
    return {"layer0": int(load[0].sum()), "others": int(load[1:].sum()), "top_k": block.routing.top_k}


def _capture_decisions(engine, group) -> dict:
    """Whether the runner would capture decode graphs on a CUDA device (nothing is allocated
    there), per dispatch and role: this rank's real expert-parallel state, and the same with the
    exact-count all-to-all."""
    padded = engine.worker.ep
    exact = copy.copy(padded)
    exact.dispatcher = AllToAllDispatcher(group)
    config = engine.config

    def captures(ep, engine_type: EngineType, eager: bool = False) -> bool:
        parallel = dataclasses.replace(config.parallel, engine_type=engine_type)
        cfg = dataclasses.replace(config, parallel=parallel, enforce_eager=eager)
        return ModelRunner(cfg, engine.worker.model, torch.device("cuda"), ep).use_cuda_graph

    roles = (EngineType.NORMAL, EngineType.COMPLETION, EngineType.PROMPT)
    return {
        name: {**{t.name: captures(ep, t) for t in roles}, "eager": captures(ep, EngineType.NORMAL, eager=True)}
        for name, ep in (("padded", padded), ("all_to_all", exact))
    }


def _serve(group, engine_kw: dict, prompts: list[list[int]]) -> dict:
    from deepinfer_core.distributed.lockstep import LockstepRank

    engine = make_rank_engine(group, **engine_kw)
    before = _addresses(engine)
    seen, maps = [], []
    placement = engine.worker.ep.placement

    def check(out) -> None:
        seen.append(_addresses(engine) == before)
        maps.append(placement.phy2log.tolist())

    engine.post_schedule = check
    lock = LockstepRank(engine, group)
    try:
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", params=greedy(MAX_NEW), prompt_token_ids=p)
        tokens = drive(lock, engine)
        counted = _count_real_rows_only(engine)
    finally:
        lock.close()
    return {
        "tokens": [tokens[f"r{i}"] for i in range(len(prompts))],
        "same_storage": seen,
        "placements": len({str(m) for m in maps}),
        "rearrangements": engine.balancer.num_rearrangements,
        "counted": counted,
        "captures": _capture_decisions(engine, group),
        "buckets": shared_buckets([1, 2, 4, 8] if group.rank == 0 else [1, 2, 4, 16], group),
        "same_buckets": shared_buckets([1, 2, 4], group),
    }


def _ranks_main(group) -> dict:
    kw = {"moe_dispatch": "padded", "eplb": EPLB, "max_num_batched_tokens": 32, "max_model_len": 32, "max_num_seqs": 4}
    ep2 = _serve(group, kw, [PROMPTS[group.rank], PROMPTS[3 - group.rank]])
    alone = [InstanceGroup.subgroup([0]), InstanceGroup.subgroup([1])]  # every rank creates both
    mine = alone[group.rank]
    ep1 = _serve(mine, kw, PROMPTS[2 * group.rank : 2 * group.rank + 2])
    return {"ep2": ep2, "ep1": ep1}


@pytest.fixture(scope="module")
def ranks():
    res = run_ranks(2, _ranks_main, (), timeout_s=540)
    errors = [r for r in res.values() if isinstance(r, str) and r.startswith(RANK_ERROR)]
    assert not errors, errors[0]
    assert sorted(res) == [0, 1]
    return res


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    engine = make_engine(dtype="float32", num_gpu_blocks=128)
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), params=greedy(MAX_NEW), prompt_token_ids=p)
    done = run_to_completion(engine)
    return [list(done[str(i)].outputs[0].token_ids) for i in range(len(PROMPTS))]


@pytest.mark.timeout(600)
def test_counter_maps_and_weights_keep_their_storage_through_rearrangements(ranks, reference):
    for rank, res in ranks.items():
        for size in ("ep2", "ep1"):
            r = res[size]
            assert r["same_storage"] and all(r["same_storage"]), (rank, size)
            assert r["rearrangements"] >= 2, (rank, size, r["rearrangements"])
            assert r["placements"] >= 2, "the placement changed during generation"
        assert res["ep2"]["tokens"] == [reference[rank], reference[3 - rank]], rank
        assert res["ep1"]["tokens"] == reference[2 * rank : 2 * rank + 2], rank


def test_only_the_real_rows_of_a_forward_count_as_expert_load(ranks):
    for res in ranks.values():
        for size in ("ep2", "ep1"):
            counted = res[size]["counted"]
            assert counted == {"layer0": counted["top_k"], "others": 0, "top_k": counted["top_k"]}


def test_every_rank_captures_the_batch_sizes_all_ranks_propose(ranks):
    for res in ranks.values():
        assert res["ep2"]["buckets"] == [1, 2, 4]
        assert res["ep2"]["same_buckets"] == [1, 2, 4]


def test_a_rearrangement_rewrites_the_maps_in_place():
    placement = ExpertPlacement.contiguous(2, E, 2, REDUNDANT)
    device_maps = placement.place_on(torch.device("cpu"))
    ptrs = [t.data_ptr() for t in (placement.phy2log, placement.logcnt, placement.log2phy, *device_maps)]
    skewed = torch.tensor([[900, 10, 10, 10, 400, 10, 10, 10], [5, 5, 5, 5, 5, 5, 300, 700]])
    new = rebalance(skewed, E + REDUNDANT, 2, "global")
    assert not torch.equal(new, placement.phy2log)
    placement.update(new)
    assert [t.data_ptr() for t in (placement.phy2log, placement.logcnt, placement.log2phy, *device_maps)] == ptrs
    assert torch.equal(placement.phy2log, new) and torch.equal(device_maps[1], placement.log2phy)
    ids = torch.arange(E).repeat(3, 1)  # every expert, from three token positions
    for layer in range(2):
        phys = placement.to_physical(layer, ids, rank=1)
        assert torch.equal(new[layer][phys], ids), layer  # each slot holds the expert routed to it
    missing = new.clone()
    missing[0] = 0  # expert 1..7 held nowhere
    with pytest.raises(ValueError, match="every logical expert at least once"):
        placement.update(missing)
    assert torch.equal(placement.phy2log, new) and torch.equal(device_maps[0], placement.logcnt)


def test_device_counts_without_a_grouped_gemm_read_nothing_back(monkeypatch):
    """The per-expert fallback (CUDA in fp32) takes the counts as a tensor: the same rows as the
    grouped GEMM, padding rows zero, and no `tolist`."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(10, 8, generator=g), torch.randn(3, 4, 8, generator=g)  # grouped GEMM: 16-byte strides
    counts = torch.tensor([2, 0, 5])  # rows 7..9: padding
    grouped = moe.grouped_linear(x, w, counts)
    monkeypatch.setattr(moe, "_grouped_mm_usable", lambda x: False)
    want = moe.grouped_linear(x, w, [2, 0, 5])  # host counts: one GEMM per expert, padding rows zero
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: pytest.fail("device counts were read back"))
    masked = moe.grouped_linear(x, w, counts)
    torch.testing.assert_close(masked, want)
    torch.testing.assert_close(masked, grouped)
    assert bool((masked[7:] == 0).all())


def test_an_ep_rank_captures_decode_graphs_only_through_the_padded_dispatch(ranks):
    for res in ranks.values():
        for size in ("ep2", "ep1"):
            assert res[size]["captures"] == {
                "padded": {"NORMAL": True, "COMPLETION": True, "PROMPT": False, "eager": False},
                "all_to_all": {"NORMAL": False, "COMPLETION": False, "PROMPT": False, "eager": False},
            }
