"""How this process's NIXL agents are set up around the agent itself: which UCX modules load, and
whether and how fast an agent's progress thread runs (shared by the KV agent, the embedding pool
and its readers)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from deepinfer_core import envs


def keep_one_libibverbs() -> None:
    """Keep UCX's EFA module out (unless the operator chose UCX's modules): the NIXL wheel bundles
    libibverbs, but its UCX `ib_efa` module links the system's libefa and libibverbs. Where the
    RDMA packages are installed (libibverbs1, ibverbs-providers: every InfiniBand/RoCE node) that
    module loads, two copies of libibverbs share the process, and it dies with SIGSEGV at exit. UCX
    reads this when its library loads, at the first agent's backend; EFA hosts use NIXL's libfabric
    backend, not this module."""
    os.environ.setdefault("UCX_MODULES", "^efa")


def wants_progress_thread(mem_type: str, sends: bool) -> bool:
    setting = envs.DEEPINFER_NIXL_PROGRESS_THREAD.strip().lower()
    if setting in ("", "auto"):
        return not (sends and mem_type == "VRAM")
    if setting in ("1", "true", "yes", "on"):
        return True
    if setting in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"DEEPINFER_NIXL_PROGRESS_THREAD must be auto, 1 or 0, not {setting!r}")


@contextlib.contextmanager
def progress_thread_delay(delay_us: int) -> Iterator[None]:
    """Agents made inside the block pause `delay_us` between progress-thread rounds.

    nixl's Python agent fixes the pause at 0: its progress thread spins, a whole core per engine
    process even when idle, and two spinning agents on a small machine starved the engines so much
    that a small write + notice + reply took many times longer than with a short pause
    (docs/benchmarks.md, "Figures formerly in code"). Transfers do not wait for the thread: polling a
    transfer or the notices drives progress on the calling thread. The knob is a config field the
    Python wrapper does not expose, so its config class is swapped for one that keeps our value
    while the agent is built (the bindings' own class is restored on exit).
    """
    from deepinfer_core.transfer.nixl_variant import api as nixl_api

    api = nixl_api()
    base = api.nixlBind.nixlAgentConfig
    if delay_us <= 0:
        yield
        return

    class _Config(base):
        def __setattr__(self, name: str, value) -> None:
            super().__setattr__(name, max(int(value), delay_us) if name == "pthrDelay" else value)

    api.nixlBind.nixlAgentConfig = _Config
    try:
        yield
    finally:
        api.nixlBind.nixlAgentConfig = base
