"""bf16 Triton kernels against the torch path in the CPU interpreter, with GPU bf16 arithmetic.

Run as `TRITON_INTERPRET=1 python -m tests.helpers.triton_bf16 OUT.json` (the variable must be set
before triton is imported). The interpreter as shipped cannot check bf16 numerics: it keeps bf16
tensors as their uint16 bits and `tl.dot` multiplies those bits as integers (garbage), and its
fp32 -> bf16 casts truncate where the GPU rounds to nearest even. `patch_interpreter` gives it the
GPU's arithmetic (bf16 dot operands widened to fp32 exactly, fp32 accumulation; RTNE casts); the
checks then compare each kernel with what the model runs on the CPU: the same roundings, so only
summation order may differ (a rare last-bit difference of a GEMM output).
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch


def patch_interpreter() -> bool:
    """False when this triton's interpreter lacks the hooks patched here (then nothing is checked)."""
    import triton.language as tl
    from triton.runtime import interpreter as interp

    builder = getattr(interp, "InterpreterBuilder", None)
    if not (hasattr(interp, "_convert_float") and hasattr(builder, "create_dot") and hasattr(interp, "TensorHandle")):
        return False
    convert, dot = interp._convert_float, builder.create_dot

    def convert_float(data, src, dst, *args, **kwargs):
        if src == tl.float32 and dst == tl.bfloat16:  # round to nearest even, as the GPU's cvt.rn
            t = torch.from_numpy(np.ascontiguousarray(data).view(np.float32).copy()).to(torch.bfloat16)
            return t.view(torch.int16).numpy().view(np.uint16).reshape(np.shape(data))
        return convert(data, src, dst, *args, **kwargs)

    def widen(h):
        if h.dtype.scalar != tl.bfloat16:
            return h
        return interp.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def create_dot(self, a, b, *args, **kwargs):
        return dot(self, widen(a), widen(b), *args, **kwargs)

    interp._convert_float = convert_float
    builder.create_dot = create_dot
    return True


def _compare(name: str, out: torch.Tensor, ref: torch.Tensor, max_fraction: float) -> dict:
    """Elements that differ at all, and by how many bf16 ulps of the reference at most."""
    out, ref = out.float(), ref.float()
    diff = (out - ref).abs()
    ulp = torch.finfo(torch.bfloat16).eps * torch.maximum(out.abs(), ref.abs()).clamp_min(
        torch.finfo(torch.bfloat16).tiny
    )
    fraction = (diff > 0).float().mean().item()
    ulps = (diff / ulp).max().item()
    ok = bool(torch.isfinite(out).all()) and fraction <= max_fraction and ulps <= 2.0
    return {"check": name, "ok": ok, "differing_fraction": fraction, "max_ulps": ulps}


def run_checks() -> list[dict]:
    from deepinfer_core.models.layers.moe import FusedExperts, RoutingConfig, permute, select_experts, unpermute
    from deepinfer_kernels import ops

    gen = torch.Generator().manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16)

    results = []
    T, H = 37, 96
    x, res, w = randn(T, H), randn(T, H), 1 + randn(H, scale=0.1)
    results.append(
        _compare("rms_norm", ops.rms_norm(x, w, 1e-6, backend="triton"), ops.rms_norm(x, w, 1e-6, backend="torch"), 0.0)
    )
    out, summed = ops.rms_norm(x, w, 1e-6, res, backend="triton")
    ref, ref_summed = ops.rms_norm(x, w, 1e-6, res, backend="torch")
    results.append(_compare("rms_norm +residual", torch.cat([out, summed]), torch.cat([ref, ref_summed]), 0.0))
    q = randn(T, 4, 16)
    angles = torch.arange(T)[:, None] * torch.rand(8, generator=gen)[None, :]
    cos, sin = angles.cos(), angles.sin()
    results.append(
        _compare("rotary", ops.rotary(q, cos, sin, backend="triton"), ops.rotary(q, cos, sin, backend="torch"), 0.0)
    )

    E, inter, k = 8, 48, 2
    experts = FusedExperts(E, H, inter, torch.bfloat16)
    with torch.no_grad():
        experts.w13_weight.copy_(randn(E, 2 * inter, H, scale=H**-0.5))
        experts.w2_weight.copy_(randn(E, H, inter, scale=inter**-0.5))
    routing = RoutingConfig(E, k, "sigmoid", "noaux_tc", n_group=4, topk_group=2, norm_topk_prob=True,
                            routed_scaling_factor=2.5, router_fp32=True)  # fmt: skip
    weights, ids = select_experts(torch.randn(T, E, generator=gen), routing, torch.randn(E, generator=gen) * 0.1)
    perm = permute(x, weights, ids, experts.local_experts)
    model_path = unpermute(experts(perm), perm, T)  # what SparseMoeBlock computes off CUDA
    kernel = ops.fused_experts(x, experts.w13_weight, experts.w2_weight, weights, ids.to(torch.int32), backend="triton")
    reference = ops.fused_experts(
        x, experts.w13_weight, experts.w2_weight, weights, ids.to(torch.int32), backend="torch"
    )
    results.append(_compare("fused_experts vs the model's torch path", kernel, model_path, 0.01))
    results.append(_compare("fused_experts vs fused_experts_ref", kernel, reference, 0.01))
    return results


def main(argv: list[str]) -> int:
    patched = patch_interpreter()
    results = run_checks() if patched else []
    with open(argv[1], "w") as f:
        json.dump({"patched": patched, "results": results}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
