"""Block-scaled FP8 weights, as DeepSeek-V3's FP8 checkpoints store them.

A weight `[out, in]` is kept as float8_e4m3fn values plus one fp32 factor per `[bn, bk]` block
(`weight_scale_inv [ceil(out / bn), ceil(in / bk)]`, the checkpoint's name for it: the inverse of
the quantization scale). The real weight is `fp8 value * factor of its block`. Stacked expert
weights carry a leading expert dimension on both.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448


def _expand(scale: torch.Tensor, shape: torch.Size, block: tuple[int, int]) -> torch.Tensor:
    """Each block's factor repeated over its elements, cut to `shape` (the last blocks may be partial)."""
    bn, bk = block
    full = scale.repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)
    return full[..., : shape[-2], : shape[-1]]


def dequantize_block_fp8(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The real weight of a block-scaled FP8 tensor (`[..., out, in]`), in `dtype`.

    The product is formed in fp32 (exact: an e4m3 value times an fp32 factor) and rounded once.
    """
    expected = (*weight.shape[:-2], -(-weight.shape[-2] // block[0]), -(-weight.shape[-1] // block[1]))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"FP8 scale of shape {tuple(scale_inv.shape)} does not fit a weight of shape {tuple(weight.shape)} "
            f"in {list(block)} blocks (expected {expected})"
        )
    return (weight.float() * _expand(scale_inv.float(), weight.shape, block)).to(dtype)


def quantize_block_fp8(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 values, fp32 `weight_scale_inv`) of a weight `[..., out, in]`: each block scaled so that its
    largest magnitude maps to the format's maximum, as DeepSeek's quantization does."""
    bn, bk = block
    out, inp = weight.shape[-2:]
    pad = (0, -inp % bk, 0, -out % bn)
    w = torch.nn.functional.pad(weight.float(), pad)
    blocks = w.unflatten(-1, (-1, bk)).unflatten(-3, (-1, bn))  # [..., out/bn, bn, in/bk, bk]
    amax = blocks.abs().amax(dim=(-3, -1)).clamp_min(1e-12)  # [..., out/bn, in/bk]
    scale_inv = amax / FP8_MAX
    q = (w / _expand(scale_inv, w.shape, block)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q[..., :out, :inp].contiguous(), scale_inv


def dequantize_gate_up(
    w13: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The real weight of stacked gate/up experts (`[..., 2I, H]`, factors `[..., 2 * ceil(I / bn), *]`).
    Gate and up were quantized separately, so each half takes its own rows of factors (a block
    never spans the two when I is not a multiple of bn)."""
    inter, half = w13.shape[-2] // 2, scale_inv.shape[-2] // 2
    return torch.cat(
        [dequantize_block_fp8(w13[..., :inter, :], scale_inv[..., :half, :], block, dtype),
         dequantize_block_fp8(w13[..., inter:, :], scale_inv[..., half:, :], block, dtype)],
        dim=-2,
    )  # fmt: skip
