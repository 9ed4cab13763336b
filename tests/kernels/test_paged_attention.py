"""The paged-attention references agree with dense causal attention and with each other."""

import math

import pytest
import torch

from deepinfer_kernels.paged_attention import (
    paged_attention_ref,
    paged_decode_attention_static,
    reshape_and_cache,
    reshape_and_cache_static,
)


def _dense(q, k, v, scale):  # q [q, Hq, D] at the end of k/v [s, Hkv, D]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    qn, kn = q.shape[0], k.shape[0]
    mask = torch.arange(kn)[None, :] <= torch.arange(kn - qn, kn)[:, None]
    s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


def _setup(lens, q_lens, block_size=4, hq=4, hkv=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum((n + block_size - 1) // block_size for n in lens) + 3
    cache = torch.zeros(num_blocks, 2, block_size, hkv, d)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, ks, vs = [], [], []
    for n in lens:
        nb = (n + block_size - 1) // block_size
        tables.append([perm.pop() for _ in range(nb)])
        ks.append(torch.randn(n, hkv, d, generator=g))
        vs.append(torch.randn(n, hkv, d, generator=g))
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    slots = torch.tensor(
        [t[p // block_size] * block_size + p % block_size for t, n in zip(tables, lens) for p in range(n)]
    )
    reshape_and_cache(torch.cat(ks), torch.cat(vs), cache, slots)
    qs = [torch.randn(ql, hq, d, generator=g) for ql in q_lens]
    return cache, bt, ks, vs, qs


@pytest.mark.parametrize("lens,q_lens", [([5, 13, 1], [5, 4, 1]), ([7, 9], [1, 1]), ([17], [17])])
def test_paged_ref_matches_dense(lens, q_lens):
    cache, bt, ks, vs, qs = _setup(lens, q_lens)
    scale = 1 / math.sqrt(8)
    out = paged_attention_ref(torch.cat(qs), cache, bt, q_lens, lens, scale)
    want = torch.cat([_dense(q, k, v, scale) for q, k, v in zip(qs, ks, vs)])
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_static_decode_matches_paged_ref_with_padding_width():
    lens = [3, 11, 6]
    cache, bt, ks, vs, qs = _setup(lens, [1, 1, 1])
    wide = torch.cat([bt, torch.zeros(3, 5, dtype=torch.int32)], dim=1)  # graph-width table
    scale = 0.3
    q = torch.cat(qs)
    ref = paged_attention_ref(q, cache, bt, [1, 1, 1], lens, scale)
    out = paged_decode_attention_static(q, cache, wide, torch.tensor(lens, dtype=torch.int32), scale)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_reshape_and_cache_skips_padding_and_static_writes_everything():
    cache = torch.zeros(3, 2, 4, 1, 2)
    k, v = torch.ones(3, 1, 2), 2 * torch.ones(3, 1, 2)
    reshape_and_cache(k, v, cache, torch.tensor([0, -1, 5]))
    assert cache[0, 0, 0].sum() == 2 and cache[1, 1, 1].sum() == 4
    assert cache.abs().sum() == 2 * (2 + 4)
    reshape_and_cache_static(k, v, cache, torch.tensor([8, 9, 10]))
    assert cache[2, 0, :3].sum() == 6 and cache[2, 1, :3].sum() == 12
