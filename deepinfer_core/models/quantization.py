"""Quantized checkpoints: which ones load, and how their tensors reach the model.

Supported: block-scaled FP8 (`quantization_config = {"quant_method": "fp8", "fmt": "e4m3",
"activation_scheme": "dynamic", "weight_block_size": [bn, bk]}`), the format of DeepSeek-V3's
release and of other block-FP8 checkpoints. Each quantized `X.weight` (float8_e4m3fn) comes with
`X.weight_scale_inv` (one fp32 factor per [bn, bk] block, see `deepinfer_kernels.fp8`).

Weights a model keeps in FP8 (`model.keeps_fp8(name)`: the routed experts, read as stored by the
fused MoE kernel) pass through with their factors; every other FP8 weight is dequantized here, in
fp32, and the loader's copy rounds it once to the model dtype.

Activations stay in the model dtype (W8A16). A "dynamic" activation scheme, which these
checkpoints name, brings no tensors: its reference implementation quantizes activations at run
time to e4m3 as well. That made the experts' prefill faster than W8A16's and than bf16 experts',
but it put the output many times further from exact fp32 than W8A16 does, so exactness wins here
(docs/benchmarks.md, "Figures formerly in code").
A "static" scheme would bring activation scales and is refused, as is every other `quant_method`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from deepinfer_kernels.fp8 import FP8_DTYPE, dequantize_block_fp8

SCALE_SUFFIX = "_scale_inv"


def fp8_block_size(hf_config: dict[str, Any]) -> tuple[int, int] | None:
    """The [bn, bk] block of a block-FP8 checkpoint, None for an unquantized one.

    Raises:
        ValueError: a quantization this engine does not load (another method, per-tensor FP8,
            static activation scales, another FP8 format).
    """
    quant = hf_config.get("quantization_config")
    if not quant:
        return None
    method = quant.get("quant_method", "unknown") if isinstance(quant, dict) else quant
    if method != "fp8":
        raise ValueError(
            f"quantized checkpoints of quant_method={method!r} are not supported (block-scaled 'fp8' is); "
            "convert the weights to bf16/fp16 first"
        )
    block = quant.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"FP8 checkpoints need a 2-d weight_block_size (per-block scales), got {block!r}")
    if any(b & (b - 1) for b in block):
        raise ValueError(f"FP8 weight_block_size must be powers of two, got {list(block)}")
    if quant.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"FP8 format {quant['fmt']!r} is not supported (e4m3 is)")
    if quant.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(
            f"FP8 activation_scheme {quant['activation_scheme']!r} is not supported: "
            "weights are dequantized in the kernels and activations stay in the model dtype ('dynamic')"
        )
    return int(block[0]), int(block[1])


def dequantize_fp8_stream(
    tensors: Iterable[tuple[str, torch.Tensor]],
    block: tuple[int, int],
    keeps_fp8: Callable[[str], bool],
    absorbed: set[str],
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each FP8 weight the model does not keep in FP8 replaced by
    its fp32 dequantization (under the weight's name); the factors it used go into `absorbed`.

    A weight and its factors may arrive in either order; one waits for the other.

    Raises:
        ValueError: an FP8 weight without its `weight_scale_inv`.
    """
    weights: dict[str, torch.Tensor] = {}  # FP8 weights waiting for their factors
    scales: dict[str, torch.Tensor] = {}  # factors waiting for their weight, by weight name
    for name, tensor in tensors:
        if name.endswith(SCALE_SUFFIX):
            base = name.removesuffix(SCALE_SUFFIX)
            if keeps_fp8(base):
                yield name, tensor
            elif base in weights:
                absorbed.add(name)
                yield base, dequantize_block_fp8(weights.pop(base), tensor, block)
            else:
                scales[base] = tensor
        elif tensor.dtype == FP8_DTYPE and not keeps_fp8(name):
            if name in scales:
                absorbed.add(name + SCALE_SUFFIX)
                yield name, dequantize_block_fp8(tensor, scales.pop(name), block)
            else:
                weights[name] = tensor
        else:
            yield name, tensor
    if weights:
        missing = sorted(weights)
        raise ValueError(f"FP8 tensor(s) without their weight{SCALE_SUFFIX}: {', '.join(missing[:10])}")
    for base, tensor in scales.items():  # factors of nothing: the loader reports them as unused
        yield base + SCALE_SUFFIX, tensor
