"""The engine's environment variables: one typed snapshot, read once at import.

`EngineArgs.__post_init__` sets role defaults with `os.environ.setdefault` (an
operator's explicit value wins) and then calls `rearm()` so the snapshot sees
them. Nothing else in the code base reads `os.environ` for engine settings.
"""

from __future__ import annotations

import os
from collections.abc import Callable


def _bool(v: str) -> bool:
    return v.strip().lower() in ("1", "true", "yes", "on")


# name -> (parser, default)
_SPECS: dict[str, tuple[Callable[[str], object], str]] = {
    "DEEPINFER_ZERO_OVERHEAD_SCHEDULING": (_bool, "1"),
    "DEEPINFER_USE_MULTIMODAL_POOL": (_bool, "1"),
    "DEEPINFER_PREFILL_ATTEMPT_INTERVAL": (int, "70"),
    "DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL": (int, "100"),
    "DEEPINFER_ENFORCE_EAGER": (_bool, "0"),
    "DEEPINFER_USE_NEXTN_DECODE": (int, "0"),
    "DEEPINFER_LOG_LEVEL": (str, "INFO"),
    "DEEPINFER_NIXL_PROGRESS_DELAY_US": (int, "200"),
    "DEEPINFER_NIXL_PROGRESS_THREAD": (str, "auto"),
    "DEEPINFER_PD_STREAM_CHUNKS": (_bool, "1"),
    "DEEPINFER_PD_LAYER_GROUPS": (int, "0"),
}

DEEPINFER_ZERO_OVERHEAD_SCHEDULING: bool
"""Overlap step N+1's host work with step N's device work (role default)."""
DEEPINFER_USE_MULTIMODAL_POOL: bool
"""Build the multimodal processor and pool (off on COMPLETION engines)."""
DEEPINFER_PREFILL_ATTEMPT_INTERVAL: int
"""NORMAL + DP: every N decode steps, prefill if ALL ranks want to."""
DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL: int
"""NORMAL + DP: every N decode steps, prefill if ANY rank wants to."""
DEEPINFER_ENFORCE_EAGER: bool
"""Never capture CUDA graphs."""
DEEPINFER_USE_NEXTN_DECODE: int
"""Draft tokens per decode step (MTP); sizes decode-side buffers."""
DEEPINFER_LOG_LEVEL: str
DEEPINFER_NIXL_PROGRESS_DELAY_US: int
"""Pause of each NIXL agent's progress thread between rounds (0: spin, a whole core per engine)."""
DEEPINFER_NIXL_PROGRESS_THREAD: str
"""NIXL progress thread: "auto" (every agent but a PE's with a GPU cache, whose engine drives
progress itself while it waits for its writes), "1" or "0"."""
DEEPINFER_PD_STREAM_CHUNKS: bool
"""PE: write each chunk's full KV blocks to the CE while the next chunk computes (chunked prefill)."""
DEEPINFER_PD_LAYER_GROUPS: int
"""PE: send the last chunk's KV in this many layer groups, each as soon as its layers are written
(0: 4 on CUDA, 1 on CPU, where the forward is synchronous and nothing would overlap)."""


def rearm(*names: str) -> None:
    """Re-read the given variables (all when none given) into the snapshot."""
    g = globals()
    for name in names or tuple(_SPECS):
        parse, default = _SPECS[name]
        raw = os.environ.get(name, default)
        try:
            g[name] = parse(raw)
        except ValueError:
            raise ValueError(f"environment variable {name}={raw!r} is not a valid {parse.__name__}") from None


rearm()
