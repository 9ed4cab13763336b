"""The launchers' host-side integer helpers: they replace Triton's constexpr functions (slow to call
from Python) and must agree with them; the split count they feed."""

import triton

from deepinfer_kernels.triton_impl.common import cdiv, next_pow2
from deepinfer_kernels.triton_impl.split_kv import choose_num_splits


def test_cdiv_and_next_pow2_match_triton():
    for a in range(0, 300):
        assert next_pow2(a) == triton.next_power_of_2(max(a, 1))
        for b in (1, 2, 3, 16, 64, 128, 257):
            assert cdiv(a, b) == triton.cdiv(a, b)
    assert cdiv(2**40 + 1, 2**20) == 2**20 + 1 and next_pow2(2**33 + 1) == 2**34


def test_choose_num_splits_fills_the_multiprocessors():
    # one wave already: no split
    assert choose_num_splits(128, 4096, 132) == 1
    # 64 sequences on 132 multiprocessors: two splits fill 128 of them
    assert choose_num_splits(64, 4096, 132) == 2
    # few long sequences: as many splits as fill the card, up to the cap
    assert choose_num_splits(4, 32768, 132) == 16
    assert choose_num_splits(8, 32768, 132) == 16
    # never fewer than min_tokens keys a split
    assert choose_num_splits(4, 512, 132, min_tokens=256) == 2
    # two programs a multiprocessor count as one wave
    assert choose_num_splits(128, 4096, 132, per_sm=2) == 2
