"""The KV cache system: tiers of stored KV blocks under one key.

    L1  the engine's prefix cache (`scheduler/block_manager.py`): blocks in the KV cache itself
    L2  a host-memory pool per engine (`host_pool.py`): framed blocks, LRU, NIXL-registered
    L3  entry files under a directory (`file_tier.py`, `index.py`): one file per block, shared by
        every engine pointed at the directory, one byte limit, LRU; written and read through NIXL's
        POSIX storage backend (`transfer/storage_io.py`). Or objects in an S3-compatible bucket
        (`object_tier.py`, `bucket.py`) through NIXL's OBJ backend (`transfer/object_io.py`)

A block's key (`keys.py`) is the chain hash of its tokens, the namespace of the model, weights
and KV layout (`identity.py`) and the content hashes of the images in it. Every entry is framed
with a version, its key and a checksum (`frame.py`); a load checks all three and a bad, short,
missing or late entry is recomputed, never served.

The CE saves (`saver.py`, from `do_save_kvcache`); the PE loads at admission (`loader.py`, from the
scheduler). `KVStore` (`store.py`) is what both hold; its file work runs on its I/O thread
(`io_thread.py`). Counters: `KVStoreStats` (`stats.py`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

from deepinfer_core.kvstore.identity import store_namespace
from deepinfer_core.kvstore.stats import KVStoreStats
from deepinfer_core.kvstore.store import KVStore

if TYPE_CHECKING:
    from deepinfer_core.config import EngineConfig
    from deepinfer_core.scheduler.block_manager import BlockManager
    from deepinfer_core.transfer.layout import KVLayout
    from deepinfer_core.worker.cache_engine import CacheEngine

logger = logging.getLogger(__name__)

__all__ = ["KVStore", "KVStoreStats", "open_store"]


def open_store(
    config: EngineConfig, cache: CacheEngine, layout: KVLayout, name: str, block_manager: Optional[BlockManager] = None
) -> Optional[KVStore]:
    """The engine's store, or None when none is configured (or the model keeps per-sequence state,
    which stored blocks alone cannot restore). `block_manager`: the engine's, for a saving engine
    on a GPU (its save copies hold the blocks instead of waiting)."""
    if not config.kv_store.enabled:
        return None
    if cache.states is not None:
        logger.warning("KV store disabled on %s: the model keeps per-sequence state beside its KV blocks", name)
        return None
    namespace = store_namespace(layout, config.model, config.kv_store.namespace)
    store = KVStore(config.kv_store, cache.kv_buffer, layout, namespace, name, block_manager)
    logger.info(
        "KV store on %s: L2 %d slots of %d bytes, L3 %s (%s, limit %.1f GiB)",
        name,
        store.pool.num_slots,
        store.pool.slot_bytes,
        store.tier.location,
        store.tier.io.name,
        config.kv_store.l3_bytes / 2**30,
    )
    return store
