"""Process-level helpers of the engine bench: a timestamped log, the copy and matmul ceilings, the
zero-overhead-scheduling switch and the device's memory bookkeeping."""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch

from benchmarks.kernel_bench.engine_spec import ZOS_ENV


class Log:
    """Prints each message with the seconds since the run started."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def __call__(self, msg: str) -> None:
        print(f"[{time.perf_counter() - self.t0:7.1f} s] {msg}", flush=True)


def _wall_median(fn: Callable[[], object], reps: int = 10) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure_ceilings(device: str) -> dict[str, Any]:
    """Copy bandwidth (bytes read + written) and matmul rate: the kernel bench's own measurement
    on CUDA (`timing.ceilings`); wall-clock medians of a 32 MiB copy and a 512^3 fp32 matmul on CPU."""
    if device.startswith("cuda"):
        from benchmarks.kernel_bench.timing import ceilings

        bw, mm = ceilings()
        torch.cuda.empty_cache()
        name, timer = torch.cuda.get_device_name(), "CUDA events"
    else:
        a = torch.randn(1 << 23)
        b = torch.empty_like(a)
        bw = 2 * a.nbytes / _wall_median(lambda: b.copy_(a))
        x = torch.randn(512, 512)
        mm = 2 * 512**3 / _wall_median(lambda: x @ x)
        name, timer = "cpu", "wall clock"
    return {"copy_GBps": bw / 1e9, "matmul_TFLOPs": mm / 1e12, "device": name, "timer": timer}


@contextlib.contextmanager
def zos_env(on: bool) -> Iterator[None]:
    """DEEPINFER_ZERO_OVERHEAD_SCHEDULING=1/0 while the block runs (engine built and stepped), then as before."""
    from deepinfer_core import envs

    before = os.environ.get(ZOS_ENV)
    os.environ[ZOS_ENV] = "1" if on else "0"
    envs.rearm(ZOS_ENV)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ZOS_ENV, None)
        else:
            os.environ[ZOS_ENV] = before
        envs.rearm(ZOS_ENV)


def peak_gib(device: str) -> Optional[float]:
    return torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None


def reset_peak(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()


def free_memory(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
