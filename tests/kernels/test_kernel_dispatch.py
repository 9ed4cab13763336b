"""The op dispatch (CPU -> reference, forced backends, lazy triton) and the new references'
own correctness against plain formulas."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from deepinfer_kernels import ops, registry
from deepinfer_kernels.fused_moe import fused_experts_ref, moe_align_ref, moe_topk_ref
from deepinfer_kernels.mla_decode import mla_decode_attention_ref

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_tensors_take_the_reference_and_triton_is_not_imported() -> None:
    code = (
        "import sys, torch\n"
        "from deepinfer_kernels import ops\n"
        "x = torch.randn(3, 8); w = torch.ones(8)\n"
        "ops.rms_norm(x, w, 1e-6)\n"
        "ops.rotary(torch.randn(3, 2, 8), torch.randn(3, 4), torch.randn(3, 4))\n"
        "assert 'triton' not in sys.modules, 'triton imported on the CPU path'\n"
        "assert not any(m.startswith('deepinfer_kernels.triton_impl') for m in sys.modules)\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


def test_backend_rules() -> None:
    cpu = torch.zeros(1)
    assert not registry.use_triton(cpu)
    assert not registry.use_triton(cpu, "torch")
    assert registry.use_triton(cpu, "triton")
    with pytest.raises(ValueError):
        registry.set_backend("cuda")
    before = registry.get_backend()
    try:
        registry.set_backend("torch")
        assert not registry.use_triton(cpu) and registry.get_backend() == "torch"
    finally:
        registry.set_backend(before)


def test_rms_norm_reference_is_the_model_norm() -> None:
    from deepinfer_core.models.layers.norm import RMSNorm

    norm = RMSNorm(16, 1e-5, dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16))
    x, r = torch.randn(5, 16, dtype=torch.bfloat16), torch.randn(5, 16, dtype=torch.bfloat16)
    assert torch.equal(ops.rms_norm(x, norm.weight, 1e-5), norm(x))
    out, summed = ops.rms_norm(x, norm.weight, 1e-5, r)
    want, want_sum = norm(x, r)
    assert torch.equal(out, want) and torch.equal(summed, want_sum)


def test_mla_reference_matches_explicit_formula() -> None:
    g = torch.Generator().manual_seed(0)
    B, H, L, R, page = 2, 3, 8, 4, 4
    lens = [5, 9]
    cache = torch.randn(6, page, L + R, generator=g)
    bt = torch.tensor([[4, 1, 0], [2, 5, 3]], dtype=torch.int32)
    qn, qp = torch.randn(B, H, L, generator=g), torch.randn(B, H, R, generator=g)
    out = mla_decode_attention_ref(qn, qp, cache, bt, torch.tensor(lens, dtype=torch.int32), 0.3)
    for b in range(B):
        rows = cache[bt[b].long()].reshape(-1, L + R)[: lens[b]]  # [S, L+R]
        p = ((torch.cat([qn[b], qp[b]], -1) @ rows.t()) * 0.3).softmax(-1)  # [H, S]
        torch.testing.assert_close(out[b], p @ rows[:, :L])


def test_moe_references_match_a_per_token_loop() -> None:
    g = torch.Generator().manual_seed(1)
    T, H, inter, E, k = 6, 8, 5, 7, 3
    x = torch.randn(T, H, generator=g)
    w13, w2 = torch.randn(E, 2 * inter, H, generator=g), torch.randn(E, H, inter, generator=g)
    weights, ids = moe_topk_ref(torch.randn(T, E, generator=g), k)
    out = fused_experts_ref(x, w13, w2, weights, ids)
    for t in range(T):
        want = sum(
            weights[t, j] * (w2[e] @ (F.silu(w13[e, :inter] @ x[t]) * (w13[e, inter:] @ x[t])))
            for j, e in enumerate(ids[t].tolist())
        )
        torch.testing.assert_close(out[t], want, atol=1e-4, rtol=1e-4)


def test_moe_align_reference_layout() -> None:
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]], dtype=torch.int32)  # expert 0: rows 1, 4; 1: 3; 2: 0, 2, 5
    sorted_ids, expert_ids, npad = moe_align_ref(ids, 4, 2)
    assert npad.tolist() == [8]
    assert expert_ids.tolist()[:4] == [0, 1, 2, 2] and all(e == -1 for e in expert_ids.tolist()[4:])
    assert sorted_ids.tolist()[:8] == [1, 4, 3, 6, 0, 2, 5, 6]  # 6 = T*k marks padding
