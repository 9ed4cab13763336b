"""The padded MoE dispatch (a fixed per-rank token bound, static shapes) against the exact-count
all-to-all, on two real ranks over gloo: the same rows reach the same local slots and come back
to the same places under even, skewed and empty loads; every collective it enters has the same
shapes and equal splits whatever the routing; a step over its bound is refused; and an engine on
it generates the tokens of one on the exact-count path."""

import pytest
import torch

from deepinfer_core.config import ParallelConfig
from deepinfer_core.distributed.dispatch import AllToAllDispatcher, make_dispatcher
from tests.helpers.engines import greedy
from tests.helpers.ep import RANK_ERROR, run_ranks, serve_prompts

SLOTS_PER_RANK, TOP_K, HIDDEN, MAX_TOKENS = 4, 2, 8, 6
MAX_NEW = 6


def _load(rank: int, trial: int, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows sorted by physical slot and the per-slot counts of one rank's routed tokens."""
    g = torch.Generator().manual_seed(100 * trial + rank)
    tokens = [MAX_TOKENS, 3, 0, MAX_TOKENS][trial] if not (trial == 2 and rank == 1) else 4  # rank 0 idle once
    pool = SLOTS_PER_RANK if trial == 3 else num_slots  # skewed: every copy to the first rank's slots
    picks = [torch.randperm(pool, generator=g)[:TOP_K] for _ in range(tokens)]
    slots = torch.cat(picks).sort().values if picks else torch.zeros(0, dtype=torch.int64)
    rows = torch.randn(slots.numel(), HIDDEN, generator=g) + slots[:, None]  # rows remember their slot
    return rows, torch.bincount(slots, minlength=num_slots)


def _experts(hidden: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """A stand-in for the local experts: a different affine map per local slot."""
    slot = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    out = torch.zeros_like(hidden)
    out[: slot.numel()] = hidden[: slot.numel()] * (slot[:, None] + 2) - 1
    return out


def _ranks_main(group, engine_kw: dict, prompts: list[list[int]]) -> dict:
    num_slots = SLOTS_PER_RANK * group.size
    exact = AllToAllDispatcher(group)
    padded = make_dispatcher(group, "padded", MAX_TOKENS, TOP_K, SLOTS_PER_RANK)
    shapes = []
    real = padded._all_to_all

    def recording(out, inp, out_splits=None, in_splits=None):
        shapes.append((tuple(out.shape), tuple(inp.shape), out_splits, in_splits))
        real(out, inp, out_splits, in_splits)

    padded._all_to_all = recording
    trials = []
    for trial in range(4):
        rows, counts = _load(group.rank, trial, num_slots)
        a, b = exact.dispatch(rows, counts), padded.dispatch(rows, counts)
        n = sum(a.counts)
        back_a = exact.combine(_experts(a.hidden, a.counts), a.handle)
        back_b = padded.combine(_experts(b.hidden, b.counts.tolist()), b.handle)
        trials.append({
            "counts": (a.counts, b.counts.tolist()),
            "rows": torch.equal(a.hidden, b.hidden[:n]),
            "padding_zero": bool((b.hidden[n:] == 0).all()),
            "combined": torch.equal(back_a, back_b) and back_b.shape == rows.shape,
            "arrived": n,
        })  # fmt: skip
    try:
        too_many = torch.zeros(MAX_TOKENS * TOP_K + 1, HIDDEN)
        padded.dispatch(
            too_many, torch.bincount(torch.zeros(too_many.shape[0], dtype=torch.int64), minlength=num_slots)
        )
        refused = ""
    except ValueError as e:
        refused = str(e)
    from tests.helpers.ep import make_rank_engine

    built = make_rank_engine(group, **engine_kw, moe_dispatch="padded").worker.ep.dispatcher
    bound = (type(built).__name__, built.max_rows)  # the role's token bound x top-k
    split = {0: prompts[:3], 1: prompts[3:]}
    tokens = {d: serve_prompts(group, {**engine_kw, "moe_dispatch": d}, split, greedy(MAX_NEW))["tokens"]
              for d in ("all_to_all", "padded")}  # fmt: skip
    return {"trials": trials, "shapes": set(shapes), "refused": refused, "tokens": tokens, "bound": bound}


def test_the_padded_dispatch_equals_the_exact_one_with_static_shapes():
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (5, 19, 2, 11)]
    engine_kw = {
        "max_num_batched_tokens": 32,
        "max_model_len": 32,
        "max_num_seqs": 4,
    }  # a small token bound: small buffers
    results = run_ranks(2, _ranks_main, (engine_kw, prompts), timeout_s=300)
    errors = [r for r in results.values() if isinstance(r, str) and r.startswith(RANK_ERROR)]
    assert not errors, errors[0]
    assert sorted(results) == [0, 1]
    for rank, result in results.items():
        for trial in result["trials"]:
            exact, padded = trial["counts"]
            assert exact == padded and trial["rows"] and trial["padding_zero"] and trial["combined"], (rank, trial)
        # two calls per dispatch and one per combine, each of one shape with equal splits
        rows_block = 2 * MAX_TOKENS * min(TOP_K, SLOTS_PER_RANK)
        assert result["shapes"] == {
            ((2 * SLOTS_PER_RANK,), (2 * SLOTS_PER_RANK,), None, None),
            ((rows_block, HIDDEN), (rows_block, HIDDEN), None, None),
        }, result["shapes"]
        assert "13 token copies exceed the padded MoE dispatch's bound of 12" in result["refused"]
        assert result["bound"] == ("PaddedAllToAllDispatcher", 32 * 2)  # max_num_batched_tokens x top-k 2
        assert result["tokens"]["padded"] == result["tokens"]["all_to_all"], rank
        assert len(result["tokens"]["padded"]) == (3 if rank == 0 else 1)
    assert results[0]["trials"][3]["arrived"] == 2 * MAX_TOKENS * TOP_K  # the skewed trial: all on rank 0


def test_an_unknown_dispatch_is_refused_before_anything_starts():

    with pytest.raises(ValueError, match="unknown moe_dispatch 'deepep'; choose all_to_all or padded"):
        ParallelConfig(moe_dispatch="deepep")
    with pytest.raises(ValueError, match="unknown MoE dispatch backend 'deepep'; available: all_to_all, padded"):
        make_dispatcher(None, "deepep")
