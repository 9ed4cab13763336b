"""Shared pieces of the KV store tests: a store over a CPU tensor, engines and requests with a store,
the entry files of a directory, and bounded waits on a store's I/O."""

from __future__ import annotations

import os
import time
from typing import Optional

import torch

from benchmarks.pd_harness import EngineProcess
from deepinfer_core.config import KVStoreConfig
from deepinfer_core.kvstore.store import KVStore
from deepinfer_core.roles import EngineType
from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.transfer.layout import KVLayout
from deepinfer_core.transfer.messages import KVTarget
from tests.helpers.pd import ENGINE_ARGS

NAMESPACE = b"test-namespace-0"


def store_config(directory: str, **kw) -> KVStoreConfig:
    return KVStoreConfig(directory=str(directory), **{"l2_bytes": 4 << 20, "l3_bytes": 64 << 20, **kw})


def bucket_store_config(url: str, endpoint: str, **kw) -> KVStoreConfig:
    """A store whose L3 is `url`'s bucket on the S3-compatible server at `endpoint`."""
    return KVStoreConfig(url=url, endpoint=endpoint, **{"l2_bytes": 4 << 20, "l3_bytes": 64 << 20, **kw})


def cpu_store(
    directory: Optional[str], num_blocks: int = 32, namespace: bytes = NAMESPACE, config=None, **kw
) -> KVStore:
    """A store over a random `[layers=3, num_blocks, 8, 6]` fp32 'KV cache' (no model); `config`
    instead of a directory for a bucket."""
    kv = torch.randn((3, num_blocks, 8, 6), generator=torch.Generator().manual_seed(0))
    layout = KVLayout.of({"architectures": ["Test"]}, kv, 8)
    return KVStore(config or store_config(directory, **kw), kv, layout, namespace, "test")


def settle(store: KVStore, timeout_s: float = 30.0) -> None:
    """Poll until the store's I/O thread has nothing in flight."""
    deadline = time.monotonic() + timeout_s
    while store.io.pending:
        assert time.monotonic() < deadline, f"{store.io.pending} store jobs still in flight"
        store.poll(wait_s=0.01)


def load_stored(store: KVStore, keys: list[bytes], blocks: list[int]):
    """Look up `keys`, load the stored prefix into `blocks` and wait: (tiers found, blocks placed)."""
    tiers = store.lookup(keys)
    load = store.start_load(keys[: len(tiers)], tiers)
    while not load.done:
        store.poll(wait_s=0.01)
    return tiers, store.finish_load(load, blocks)


def entry_files(directory: str) -> list[str]:
    """Paths of the published entry files under a store directory, sorted."""
    return sorted(
        os.path.join(root, f) for root, _, files in os.walk(directory) for f in files if f.endswith(".kvblock")
    )


def directory_bytes(directory: str) -> int:
    """Bytes of every entry file, finished or being written (the index itself not counted); a file
    that goes while it is being counted counts 0."""
    total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            if name.endswith((".kvblock", ".tmp")):
                try:
                    total += os.path.getsize(os.path.join(root, name))
                except FileNotFoundError:
                    pass
    return total


def start_engine(engine_type: EngineType, **kw) -> EngineProcess:
    extra = {"stop_preempted_request": True} if engine_type == EngineType.COMPLETION else {}
    return EngineProcess(engine_type, {**ENGINE_ARGS, **extra, **kw})


def connect(pe: EngineProcess, ce: EngineProcess) -> None:
    pe.call("connect_peer", ce.info["agent_name"], ce.info["agent_metadata"], ce.info["kv_region"])


def submit(
    pe: EngineProcess,
    ce: EngineProcess,
    rid: str,
    prompt: list[int],
    params: SamplingParams,
    images: Optional[dict] = None,
) -> None:
    target = ce.call("reserve", rid, params, prompt, 30.0)
    pe.call("add_prefill", rid, target, params, prompt, images)


def reserve(ce: EngineProcess, rid: str, prompt: list[int], params: SamplingParams) -> KVTarget:
    return KVTarget.from_bytes(ce.call("reserve", rid, params, prompt, 30.0))


def wait_store_idle(engine: EngineProcess, timeout_s: float = 30.0) -> dict:
    """An engine process's store stats once no save or load is in flight and no pool slot is pinned."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = engine.call("kv_store_stats")
        if not (stats["inflight_saves"] or stats["inflight_loads"] or stats["l2_pins"]):
            return stats
        assert time.monotonic() < deadline, f"store never went idle: {stats}"
        time.sleep(0.01)
