"""The expert-parallel layer's weighted sum of a token's expert outputs: the single-rank layer's
`index_add_` order and rounding exactly, and on a GPU the same bits on every run (no atomics)."""

import pytest
import torch

from deepinfer_core.distributed.expert_parallel import weighted_sum


def _case(T: int, k: int, E: int, H: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if T else torch.empty(0, k).long()
    back = (torch.randn(T * k, H, generator=g) * 4).to(dtype)
    weights = torch.rand(T, k, generator=g)
    return back, weights, ids


def _index_add(back, weights, ids, dtype):
    """The single-rank summation: rows ordered by expert id, each added into its token in turn."""
    T, k = ids.shape
    flat = ids.reshape(-1)
    by_expert = torch.argsort(flat, stable=True)
    weighted = (back[by_expert] * weights.reshape(-1)[by_expert, None]).to(dtype)
    token_of = torch.arange(T).repeat_interleave(k)
    return torch.zeros(T, back.shape[1], dtype=dtype).index_add_(0, token_of[by_expert], weighted)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T", [0, 1, 37])
def test_equals_the_single_rank_index_add_bit_for_bit(dtype, T):
    back, weights, ids = _case(T, 8, 64, 96, dtype, seed=T)
    got = weighted_sum(back, weights, ids, dtype)
    assert got.dtype == dtype and got.shape == (T, 96)
    assert torch.equal(got, _index_add(back, weights, ids, dtype))


def test_rounding_after_each_add_would_change_the_bits():
    """The rounding matters (so the test above can fail): rounding to bf16 after each add, as a
    bf16 scatter does on a GPU, gives other bits for some tokens."""
    back, weights, ids = _case(64, 8, 64, 96, torch.bfloat16, seed=5)
    terms = (back * weights.reshape(-1, 1)).to(torch.bfloat16).view(64, 8, 96)
    rounded_each_add = torch.zeros(64, 96, dtype=torch.bfloat16)
    for j in range(8):
        rounded_each_add += terms[:, j]
    assert not torch.equal(rounded_each_add, _index_add(back, weights, ids, torch.bfloat16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_every_run_gives_the_same_bits_as_the_cpu():
    back, weights, ids = _case(512, 8, 256, 1024, torch.bfloat16, seed=7)
    want = _index_add(back, weights, ids, torch.bfloat16)
    cuda = [t.cuda() for t in (back, weights, ids)]
    runs = [weighted_sum(*cuda, torch.bfloat16).cpu() for _ in range(5)]
    assert all(torch.equal(r, want) for r in runs)
