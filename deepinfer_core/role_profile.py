"""SPEC §1's role table as data.

Code asks the profile (`role_profile(t).use_cuda_graph`) instead of repeating
`if engine_type != ...` checks across the code base. Scheduler branches stay in
the scheduler (SPEC §3); everything else that depends on the role lives here.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer_core.engine_type import EngineType


@dataclass(frozen=True)
class RoleProfile:
    engine_type: EngineType
    empty_prefill_returns_output: bool
    """An empty prefill schedule yields an empty prefill output (True) or None."""
    chunked_prefill_stops_after_first_chunk: bool
    """Stop picking prefill work after the first chunked request in a step."""
    reserves_capacity_on_add: bool
    """`add_sequence` reserves output-token and block-table capacity."""
    multimodal_pool_default: bool
    """Default of DEEPINFER_USE_MULTIMODAL_POOL; off means no processor is built."""
    profile_with_prefill_shapes: bool
    """Memory profiling runs prefill shapes (True) or decode shapes (False)."""
    cuda_graphs_allowed: bool
    speculative_slot_pool: bool
    """MTP / speculative-decoding slot pool is built."""
    init_pd_split: bool
    """`init_pd_split()` is called when the KV cache is initialised."""
    context_parallel_allowed: bool
    requires_stop_preempted_request: bool
    finalizes_finished_seqs: bool
    """`finalize_seq` is called on finished sequences (never on a PE)."""
    moe_token_bound: str
    """Which token bound sizes MoE / workspace buffers: 'prefill' or 'decode'."""
    eplb_counts_prefill_steps: bool
    """EPLB rearrangement counter advances on prefill steps."""

    @property
    def default_zero_overhead_scheduling(self) -> bool:
        return self.engine_type.default_zero_overhead_scheduling


_PROFILES = {
    EngineType.NORMAL: RoleProfile(
        engine_type=EngineType.NORMAL,
        empty_prefill_returns_output=False,
        chunked_prefill_stops_after_first_chunk=True,
        reserves_capacity_on_add=True,
        multimodal_pool_default=True,
        profile_with_prefill_shapes=True,
        cuda_graphs_allowed=True,
        speculative_slot_pool=True,
        init_pd_split=False,
        context_parallel_allowed=True,
        requires_stop_preempted_request=False,
        finalizes_finished_seqs=True,
        moe_token_bound="prefill",
        eplb_counts_prefill_steps=False,
    ),
    EngineType.PROMPT: RoleProfile(
        engine_type=EngineType.PROMPT,
        empty_prefill_returns_output=True,
        chunked_prefill_stops_after_first_chunk=False,
        reserves_capacity_on_add=False,
        multimodal_pool_default=True,
        profile_with_prefill_shapes=True,
        cuda_graphs_allowed=False,
        speculative_slot_pool=False,
        init_pd_split=True,
        context_parallel_allowed=True,
        requires_stop_preempted_request=False,
        finalizes_finished_seqs=False,
        moe_token_bound="prefill",
        eplb_counts_prefill_steps=True,
    ),
    EngineType.COMPLETION: RoleProfile(
        engine_type=EngineType.COMPLETION,
        empty_prefill_returns_output=False,
        chunked_prefill_stops_after_first_chunk=False,
        reserves_capacity_on_add=False,
        multimodal_pool_default=False,
        profile_with_prefill_shapes=False,
        cuda_graphs_allowed=True,
        speculative_slot_pool=True,
        init_pd_split=True,
        context_parallel_allowed=False,
        requires_stop_preempted_request=True,
        finalizes_finished_seqs=True,
        moe_token_bound="decode",
        eplb_counts_prefill_steps=True,
    ),
}


def role_profile(engine_type: EngineType) -> RoleProfile:
    try:
        return _PROFILES[engine_type]
    except KeyError:
        raise ValueError(f"unknown engine_type {engine_type!r}") from None
