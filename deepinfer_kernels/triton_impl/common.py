"""Small helpers shared by the Triton launchers."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from deepinfer_kernels.registry import interpreting


# Host-side integer helpers in plain Python: Triton's `cdiv` and `next_power_of_2` are constexpr
# functions with a slow call path from the host, and a launcher called them up to a dozen times per
# op (docs/benchmarks.md, "Figures formerly in code").
def cdiv(a: int, b: int) -> int:
    return -(-int(a) // int(b))


def next_pow2(n: int) -> int:
    return 1 << (max(int(n), 1) - 1).bit_length()


@functools.lru_cache(maxsize=8)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Multiprocessors of the tensor's device (a nominal 8 off the GPU, e.g. in the interpreter)."""
    if device.type != "cuda":
        return 8
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def small_tiles() -> bool:
    """True in the CPU interpreter, where every program costs host time: use the smallest tiles."""
    return interpreting()


@triton.jit
def dot(a, b, acc, IEEE: tl.constexpr):
    """acc + a @ b; fp32 operands in full fp32 (IEEE) where asked, not tf32 (the numerics tests' dtype)."""
    if IEEE:
        return tl.dot(a, b, acc=acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc=acc)


def ieee(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32
