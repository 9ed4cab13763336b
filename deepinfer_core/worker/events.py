"""Completion events for work queued off the engine thread.

On CUDA an event is recorded on the current stream. On CPU the same contract is kept
with a worker thread: the work runs asynchronously and `synchronize()` waits for it,
so code that forgets to synchronise is wrong on both devices, not only on GPUs.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

_host_queue = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deepinfer-host-copy")


class DeviceEvent:
    def __init__(self, cuda_event: torch.cuda.Event | None = None, future: Future | None = None):
        self._cuda = cuda_event
        self._future = future

    def synchronize(self) -> None:
        if self._cuda is not None:
            self._cuda.synchronize()
        elif self._future is not None:
            self._future.result()

    def query(self) -> bool:
        """True when the work is complete."""
        if self._cuda is not None:
            return self._cuda.query()
        return self._future is None or self._future.done()


def launch_async(fn: Callable[[], None], device: torch.device) -> DeviceEvent:
    """Queue `fn` (device copies) and return its completion event."""
    if device.type == "cuda":
        fn()
        event = torch.cuda.Event()
        event.record()
        return DeviceEvent(cuda_event=event)
    return DeviceEvent(future=_host_queue.submit(fn))


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of host `values` on `device`, without waiting for the device.

    `torch.tensor(values, device="cuda")` copies from pageable memory and synchronises the
    stream, i.e. waits for every kernel queued before it. With zero-overhead scheduling the
    next step's inputs are built while the current step runs, so host-to-device copies go
    through pinned memory, non-blocking (the caching host allocator keeps the pinned buffer
    until the copy has run). On CPU this is a plain tensor.
    """
    host = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class HostCopy:
    """Device tensors on their way to the host, started now and read later.

    `.tolist()` on a CUDA tensor copies on the current stream, so it waits for every kernel
    queued so far, including a step launched after the one being read: with zero-overhead
    scheduling that would make step N's read-back wait for step N+1 and leave the GPU idle while
    the host post-processes. The copies are queued right after the tensors are produced instead
    (pinned buffers, non-blocking) with an event behind them; `wait()` waits for that event only.
    On CPU the tensors are returned as they are.
    """

    def __init__(self, tensors: list[torch.Tensor | None]):
        self._event = None
        if not any(t is not None and t.is_cuda for t in tensors):
            self._host = tensors
            return
        self._host = [None if t is None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        for host, t in zip(self._host, tensors):
            if t is not None:
                host.copy_(t, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()

    def wait(self) -> list[torch.Tensor | None]:
        if self._event is not None:
            self._event.synchronize()
        return self._host
