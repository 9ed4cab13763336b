"""`EngineLoad`: what a host reads off an engine to route, scale and report on it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineLoad:
    """A snapshot taken on the engine's thread (`LLMEngine.load()`); plain values, safe to share."""

    queued_prompt_tokens: int = 0
    """Prompt tokens waiting to be computed."""
    running_requests: int = 0
    """Sequences decoding, or handed off and about to (a CE's `prompted`)."""
    waiting_requests: int = 0
    total_kv_tokens: int = 0
    """Tokens the running, prompted and reserved sequences hold in the KV cache."""
    kv_usage: float = 0.0
    free_blocks: int = 0
    num_blocks: int = 0
    requests: int = 0
    """Requests the engine still holds in any form (scheduled, reserved, or in a hand-off)."""
    reservations: int = 0
    """CE: KV reservations waiting for their hand-off."""
    fenced_reservations: int = 0
    """CE: reservations that ended early whose blocks are fenced (a PE may still write them)."""
    prefix_queries: int = 0
    prefix_hits: int = 0
    kv_transfer_bytes: int = 0
    """PE: bytes its KV writes have sent."""
    handoffs: int = 0
    """CE: hand-offs received."""
    computed_prompt_tokens: int = 0
    transfer_peers: int = 0
    """PE: decode engines' transfer agents it is connected to (a CE that left is let go)."""
    """PE: prompt tokens its prefill steps computed (every other prompt token came from a cache tier)."""
    # The KV store's counters (`kvstore.stats.KVStoreStats`; all 0 without a store). Tokens are prompt
    # tokens a PE looked up past its own prefix cache; bytes per tier, L2 the host pool, L3 the files.
    kv_store_hit_tokens_l2: int = 0
    kv_store_hit_tokens_l3: int = 0
    kv_store_miss_tokens: int = 0
    kv_store_load_bytes_l2: int = 0
    kv_store_load_bytes_l3: int = 0
    kv_store_saved_bytes: int = 0
    """CE: bytes written to the store's files."""
    kv_store_load_seconds: float = 0.0
    kv_store_load_failures: int = 0
    """Loads dropped (I/O error, entry gone, past the deadline) and recomputed."""
    kv_store_corrupt_entries: int = 0
    kv_store_evictions_l2: int = 0
    kv_store_evictions_l3: int = 0
    kv_store_l2_bytes: int = 0
    """Bytes held in the host pool now."""
    kv_store_l3_bytes: int = 0
    """Bytes of entry files in the store's directory (all engines), as last seen."""
    kv_store_loads: int = 0
    """Loads that placed at least one block (`kv_store_load_seconds` is summed over them)."""
    kv_store_l2_capacity_bytes: int = 0
    kv_store_l3_capacity_bytes: int = 0
    local_prefills: int = 0
    """CE: prompts it prefilled itself, their uncached part being short (conditional disaggregation)."""
    # Speculative decoding (MTP drafts; all 0 on an engine that does not draft).
    spec_draft_tokens: int = 0
    """Draft tokens the target verified."""
    spec_accepted_tokens: int = 0
    """Of which accepted."""
    spec_proposed_per_position: list[int] = field(default_factory=list)
    """[nextn]: drafts verified at draft position j (1st, 2nd, ... token after the last one)."""
    spec_accepted_per_position: list[int] = field(default_factory=list)
    """[nextn]: of which accepted (acceptance rate at j = accepted / proposed)."""
    # An expert-parallel rank (`deepinfer_core.distributed`; ep_size 1: a single-process engine).
    ep_rank: int = 0
    ep_size: int = 1
    dummy_steps: int = 0
    """Steps this rank ran with nothing scheduled, to keep its instance's collectives in lockstep."""
    eplb_rearrangements: int = 0
    moe_load_imbalance: float = 0.0
    """max / mean routed tokens per rank of the instance, as last measured (0: not measured)."""
