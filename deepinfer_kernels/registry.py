"""Which implementation of an op runs: the Triton kernel or the pure-torch reference.

Every public op in this package (`deepinfer_kernels.ops`) asks `use_triton(tensor)`:

- `backend="auto"` (the default): CUDA tensors run the Triton kernel, anything else the reference;
- `backend="torch"`: always the reference (a numerics baseline, or a GPU without Triton);
- `backend="triton"`: always the Triton kernel; on CPU this needs `TRITON_INTERPRET=1`
  set before triton is imported (the interpreter runs kernels over CPU tensors).

The backend comes from `set_backend()` or, at import, from the one variable this package reads,
`DEEPINFER_KERNEL_BACKEND` (the kernels layer imports nothing from the engine, so it cannot take
its config). Triton itself is imported only when a kernel first runs: importing `deepinfer_kernels` on a
machine without triton costs nothing.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import torch

BACKENDS = ("auto", "torch", "triton")
_backend = os.environ.get("DEEPINFER_KERNEL_BACKEND", "auto").strip().lower() or "auto"
_available: bool | None = None


def set_backend(backend: str) -> None:
    """Choose the implementation for every op: "auto", "torch" or "triton"."""
    global _backend
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; choose one of {BACKENDS}")
    _backend = backend


def get_backend() -> str:
    return _backend


def triton_available() -> bool:
    """True when triton imports (checked once)."""
    global _available
    if _available is None:
        try:
            importlib.import_module("triton")
            _available = True
        except ImportError:
            _available = False
    return _available


def interpreting() -> bool:
    """True when Triton kernels run through the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(t: torch.Tensor, backend: str | None = None) -> bool:
    """Whether an op on tensor `t` runs its Triton kernel (see the module doc for the rules)."""
    backend = backend or _backend
    if backend == "torch":
        return False
    if backend == "triton":
        return True
    return t.is_cuda and triton_available()


def triton_module(name: str) -> ModuleType:
    """The Triton implementation module `deepinfer_kernels.triton_impl.<name>`, imported on first use."""
    return importlib.import_module(f"deepinfer_kernels.triton_impl.{name}")
