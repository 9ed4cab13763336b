"""`KVStoreStats`: the KV store's counters, for the services to export (also flat on `EngineLoad`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from deepinfer_core.engine.load import EngineLoad


@dataclass
class KVStoreStats:
    """Counters since the engine started (totals) and gauges (now). Tokens are prompt tokens of the
    prompts a PE looked up past its own prefix cache (L1, counted by `EngineLoad.prefix_hits`)."""

    lookups: int = 0
    """Prompts looked up in the store."""
    hit_tokens_l2: int = 0
    """Tokens loaded from this engine's host pool."""
    hit_tokens_l3: int = 0
    """Tokens loaded from entry files."""
    miss_tokens: int = 0
    """Tokens of looked-up prompts that were computed (no tier had them, or their load failed)."""
    load_bytes_l2: int = 0
    load_bytes_l3: int = 0
    loads: int = 0
    """Loads that placed at least one block."""
    load_seconds: float = 0.0
    """Summed over loads: from admission to the blocks in the KV cache."""
    load_failures: int = 0
    """Loads (or their tails) dropped on an I/O error or an entry gone since the lookup."""
    load_timeouts: int = 0
    """Loads dropped for taking longer than `KVStoreConfig.load_timeout_s`."""
    corrupt_entries: int = 0
    """Entries that failed their checks (checksum, key, size, header), dropped from the store."""
    saved_blocks: int = 0
    saved_bytes: int = 0
    """Bytes written to entry files."""
    save_skipped_blocks: int = 0
    """Blocks a save found stored already."""
    save_dropped_blocks: int = 0
    """Blocks not saved: no free staging in the pool, the store full of entries being written, or a failed write."""
    evictions_l2: int = 0
    evictions_l3: int = 0
    """Entries this engine evicted from the directory to make room."""
    l2_bytes: int = 0
    """Bytes of entries in the host pool now."""
    l2_capacity_bytes: int = 0
    l3_bytes: int = 0
    """Bytes of entry files in the directory (all engines), as last seen."""
    l3_capacity_bytes: int = 0
    l2_pins: int = 0
    """Pool slots held by a save or load in flight now (0 when idle)."""
    held_blocks: int = 0
    """KV blocks a GPU save's copy still reads (held from reuse until it ends; 0 when idle)."""
    inflight_loads: int = 0
    inflight_saves: int = 0

    @property
    def hit_tokens(self) -> int:
        return self.hit_tokens_l2 + self.hit_tokens_l3

    @property
    def hit_rate(self) -> float:
        looked = self.hit_tokens + self.miss_tokens
        return self.hit_tokens / looked if looked else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "hit_tokens": self.hit_tokens, "hit_rate": self.hit_rate}

    def add_to(self, load: EngineLoad) -> None:
        """Copy the counters the services export onto an engine's load snapshot."""
        load.kv_store_hit_tokens_l2 = self.hit_tokens_l2
        load.kv_store_hit_tokens_l3 = self.hit_tokens_l3
        load.kv_store_miss_tokens = self.miss_tokens
        load.kv_store_load_bytes_l2 = self.load_bytes_l2
        load.kv_store_load_bytes_l3 = self.load_bytes_l3
        load.kv_store_saved_bytes = self.saved_bytes
        load.kv_store_load_seconds = self.load_seconds
        load.kv_store_load_failures = self.load_failures + self.load_timeouts
        load.kv_store_corrupt_entries = self.corrupt_entries
        load.kv_store_evictions_l2 = self.evictions_l2
        load.kv_store_evictions_l3 = self.evictions_l3
        load.kv_store_l2_bytes = self.l2_bytes
        load.kv_store_l3_bytes = self.l3_bytes
        load.kv_store_loads = self.loads
        load.kv_store_l2_capacity_bytes = self.l2_capacity_bytes
        load.kv_store_l3_capacity_bytes = self.l3_capacity_bytes
