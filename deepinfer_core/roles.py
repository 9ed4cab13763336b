"""The engine roles (SPEC §1): one engine class plays three roles; the role is `EngineType`, and
what the role changes is the table below, as data.

Code asks the table (`config.role.cuda_graphs_allowed`) instead of repeating `if engine_type ...`
checks across the code base. What stays a switch on `EngineType`: the scheduler's three-way role
branch (SPEC §3); the PromptEngine / CompletionEngine constructors check their role through
`require_role`, and invariant 2 is the `only_prefill_steps` row.

The integer values of `EngineType` cross process boundaries (the proto enum, the router, the
wire format of hand-offs): keep them identical everywhere.
"""

from __future__ import annotations

import enum
import importlib
from dataclasses import dataclass
from typing import Literal


class EngineType(enum.Enum):
    """What an `LLMEngine` instance does in the cluster."""

    NORMAL = 0  # prefill and decode in one engine
    PROMPT = 1  # prefill only ("PE"): hands KV and the first token to a CE
    COMPLETION = 2  # decode only ("CE"): receives KV from a PE

    @property
    def default_zero_overhead_scheduling(self) -> bool:
        """Whether step N+1's CPU work overlaps step N's device work by default.

        Off for PROMPT: a prefill step's host work is large and a PE must hand
        requests off as soon as possible; a one-beat delay adds hand-off latency.
        """
        return self in (EngineType.NORMAL, EngineType.COMPLETION)

    @property
    def short_name(self) -> str:
        return self.name


@dataclass(frozen=True)
class RoleProfile:
    """One row per role of SPEC §1's table; each field names the code that reads it."""

    engine_type: EngineType
    engine_class: str
    """"module:Class" of the engine built for this role (`engine_class()`)."""
    votes_on_step_kind: bool
    """With data parallelism the ranks vote on each step's kind (`DPVote`): MoE all-to-all needs
    every rank in the same kind of step. Only an engine that runs both kinds has a choice."""
    empty_prefill_returns_output: bool
    """An empty prefill schedule yields an empty prefill output (True) or None, so that the
    scheduler falls through to decode (`Scheduler._schedule_prefill`)."""
    reserves_capacity_on_add: bool
    """`Scheduler.add_sequence` reserves output-token and block-table capacity."""
    requires_stop_preempted_request: bool
    """A preempted request cannot be recomputed (no prefill channel): `SchedulerConfig` refuses
    `stop_preempted_request=False`."""
    eplb_counts_every_step: bool
    """The expert balancer's step count (`Scheduler.expert_balance_steps`) advances on every
    step; False: not on prefill steps, nor on the step right after one."""
    eplb_policy: Literal["hierarchical", "global"]
    """The balancer's default policy (`ExpertBalancer`): hierarchical for prefill instances (small EP,
    few nodes: keep expert groups inside a node), global for decode (wide EP)."""
    eplb_interval: int
    """Counted steps between rearrangements by default (the seed: decode ~10,000, prefill ~1,000)."""
    hands_off_prompts: bool
    """The step's post-process hands prefilled sequences off (`send_processed_prompts`)."""
    finalizes_finished_seqs: bool
    """`finalize_seq` runs on finished sequences; a PE never calls it (its blocks are in flight)."""
    init_pd_split: bool
    """`init_pd_split()` runs when the KV cache is initialised (a KV transfer agent is built)."""
    context_parallel_allowed: bool
    """`LLMEngine` refuses context_parallel_size > 1 otherwise (a CE's KV comes whole from a PE)."""
    multimodal_pool_default: bool
    """Default of DEEPINFER_USE_MULTIMODAL_POOL (`EngineArgs`); off means no processor is built."""
    cuda_graphs_allowed: bool
    """`ModelRunner` captures decode CUDA graphs (unless eager)."""
    peak_step: Literal["prefill", "decode"]
    """The kind of this role's largest forward: it shapes the memory profile
    (`ModelRunner.profile_shapes`) and bounds a forward's tokens (`SchedulerConfig.max_step_tokens`,
    the MoE / workspace bound). NORMAL runs both kinds, so its bound is the prefill one."""
    speculative_decoding: bool
    """Decode steps feed DEEPINFER_USE_NEXTN_DECODE draft tokens per sequence (MTP slots);
    a PE never decodes, so it sizes nothing for them (`EngineArgs`)."""
    only_prefill_steps: bool
    """Every non-empty step is a prefill step (invariant 2; `LLMEngine.step` asserts it)."""
    prefills_short_prompts: bool
    """Conditional disaggregation: the engine prefills prompts whose uncached part is short
    (`PDConfig.local_prefill_tokens`) in a step of their own, within its decode step's token bound
    (`CompletionEngine.add_local_prefill`). NORMAL prefills everything anyway; a PE is the prefill."""

    @property
    def default_zero_overhead_scheduling(self) -> bool:
        return self.engine_type.default_zero_overhead_scheduling

    @property
    def steps_may_overlap(self) -> bool:
        """Zero-overhead scheduling is allowed at all: not where a step hands its prompts off in
        its own post-process (a PE), whatever the environment says."""
        return not self.hands_off_prompts


_PROFILES = {
    EngineType.NORMAL: RoleProfile(
        engine_type=EngineType.NORMAL,
        engine_class="deepinfer_core.engine.llm_engine:LLMEngine",
        votes_on_step_kind=True,
        empty_prefill_returns_output=False,
        reserves_capacity_on_add=True,
        requires_stop_preempted_request=False,
        eplb_counts_every_step=False,
        eplb_policy="hierarchical",
        eplb_interval=1000,
        hands_off_prompts=False,
        finalizes_finished_seqs=True,
        init_pd_split=False,
        context_parallel_allowed=True,
        multimodal_pool_default=True,
        cuda_graphs_allowed=True,
        peak_step="prefill",
        speculative_decoding=True,
        only_prefill_steps=False,
        prefills_short_prompts=False,
    ),
    EngineType.PROMPT: RoleProfile(
        engine_type=EngineType.PROMPT,
        engine_class="deepinfer_core.pd.prompt_engine:PromptEngine",
        votes_on_step_kind=False,
        empty_prefill_returns_output=True,
        reserves_capacity_on_add=False,
        requires_stop_preempted_request=False,
        eplb_counts_every_step=True,
        eplb_policy="hierarchical",
        eplb_interval=1000,
        hands_off_prompts=True,
        finalizes_finished_seqs=False,
        init_pd_split=True,
        context_parallel_allowed=True,
        multimodal_pool_default=True,
        cuda_graphs_allowed=False,
        peak_step="prefill",
        speculative_decoding=False,
        only_prefill_steps=True,
        prefills_short_prompts=False,
    ),
    EngineType.COMPLETION: RoleProfile(
        engine_type=EngineType.COMPLETION,
        engine_class="deepinfer_core.pd.completion_engine:CompletionEngine",
        votes_on_step_kind=False,
        empty_prefill_returns_output=False,
        reserves_capacity_on_add=False,
        requires_stop_preempted_request=True,
        eplb_counts_every_step=True,
        eplb_policy="global",
        eplb_interval=10_000,
        hands_off_prompts=False,
        finalizes_finished_seqs=True,
        init_pd_split=True,
        context_parallel_allowed=False,
        multimodal_pool_default=False,
        cuda_graphs_allowed=True,
        peak_step="decode",
        speculative_decoding=True,
        only_prefill_steps=False,
        prefills_short_prompts=True,
    ),
}


def role_profile(engine_type: EngineType) -> RoleProfile:
    try:
        return _PROFILES[engine_type]
    except KeyError:
        raise ValueError(f"unknown engine_type {engine_type!r}") from None


def require_role(engine_type: EngineType, wanted: EngineType, engine: str) -> None:
    """The role check of a role's own engine class (`PromptEngine`, `CompletionEngine`)."""
    if engine_type != wanted:
        raise ValueError(f"{engine} needs engine_type={wanted.name}, got {engine_type.name}")


def engine_class(engine_type: EngineType) -> type:
    """The engine class of a role: LLMEngine, PromptEngine or CompletionEngine.

    Imported on first use, so that reading the role table pulls in no model code."""
    module, name = role_profile(engine_type).engine_class.split(":")
    return getattr(importlib.import_module(module), name)
