"""Expert parallelism applied to a model from outside: routed experts sharded over the ranks.

`apply_expert_parallel(model, group, num_redundant)` keeps on each rank only the physical slots
it owns (`ExpertPlacement`) and gives every `SparseMoeBlock` an `ExpertParallelMoE`, which runs
the routed experts of one layer across the instance:

    ids [T, k] logical -> physical slots [T*k]; rows sorted by slot        (route, permute)
    dispatch: rows to the slots' ranks (counts first, then rows)            (`MoEDispatcher`)
    local experts over the rows that arrived, grouped by local slot         (`FusedExperts`)
    combine: results back to their source ranks
    each token's k terms weighted and summed in logical-expert order        (unpermute)

Attention, dense MLPs, shared experts, embeddings and the head stay whole on every rank (DP
attention). Summing in logical-expert order makes a token's output independent of where its
experts live, so EP=N and every EPLB placement give the single-rank numbers.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from deepinfer_core.distributed.dispatch import MoEDispatcher, make_dispatcher
from deepinfer_core.distributed.group import InstanceGroup
from deepinfer_core.distributed.placement import ExpertPlacement
from deepinfer_core.models.layers.moe import FusedExperts, PermutedTokens, SparseMoeBlock


def count_ids(ids: torch.Tensor, n: int) -> torch.Tensor:
    """[n] int64: how often each id in [0, n) occurs in `ids`. Not `torch.bincount`, whose CUDA
    kernel reads the input's max back to the host: this stays on the device and inside a CUDA graph."""
    return torch.zeros(n, dtype=torch.int64, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))


class ExpertParallelMoE:
    """The routed experts of MoE layer `layer` over the instance (set as `SparseMoeBlock.ep`)."""

    def __init__(self, layer: int, placement: ExpertPlacement, group: InstanceGroup, dispatcher: MoEDispatcher):
        self.layer = layer
        self.placement = placement
        self.group = group
        self.dispatcher = dispatcher
        self.load: Optional[torch.Tensor] = None
        """[E] int64: this rank's tokens routed to each logical expert since `ExpertParallel.take_load`."""

    def __call__(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: FusedExperts
    ) -> torch.Tensor:
        T, k = ids.shape  # x: [T, H], weights/ids: [T, k]
        flat_ids = ids.reshape(-1)  # [T*k] logical
        self._count(flat_ids)
        phys = self.placement.to_physical(self.layer, ids, self.group.rank).reshape(-1)  # [T*k]
        order = torch.argsort(phys, stable=True)
        token_of = torch.arange(T, device=x.device).repeat_interleave(k)  # [T*k]
        slot_counts = count_ids(phys, self.placement.num_slots)
        sent = self.dispatcher.dispatch(x[token_of[order]], slot_counts)
        empty = torch.empty(0, dtype=torch.int64, device=x.device)
        y = experts(PermutedTokens(sent.hidden, empty, empty.float(), sent.counts))  # [M, H]
        back = torch.empty(T * k, x.shape[1], dtype=y.dtype, device=x.device)
        back[order] = self.dispatcher.combine(y, sent.handle)  # [T*k, H] in (token, j) order
        by_expert = torch.argsort(flat_ids, stable=True)  # the single-rank summation order
        weighted = (back[by_expert] * weights.reshape(-1)[by_expert, None]).to(y.dtype)
        out = torch.zeros(T, x.shape[1], dtype=y.dtype, device=x.device)
        return out.index_add_(0, token_of[by_expert], weighted)

    def _count(self, flat_ids: torch.Tensor) -> None:
        counts = count_ids(flat_ids, self.placement.num_experts)
        self.load = counts if self.load is None else self.load + counts


def shard_experts(experts: FusedExperts, slots: list[int]) -> None:
    """Keep only the experts of `slots` (logical id per local slot, repeats allowed), in place:
    every stacked tensor becomes [len(slots), ...], slot i holding expert slots[i]."""
    held = list(experts.local_experts)
    if held == list(slots):  # built as this rank's shard (`building_local_experts`)
        return
    idx = torch.tensor([held.index(e) for e in slots], dtype=torch.long)
    for name, p in list(experts.named_parameters(recurse=False)):
        kept = p.data.index_select(0, idx.to(p.device))
        setattr(experts, name, nn.Parameter(kept, requires_grad=p.requires_grad))
    experts.local_experts = list(slots)


class ExpertParallel:
    """A model's expert-parallel state on one rank: the placement, the layers' runners, the load."""

    def __init__(self, blocks: list[SparseMoeBlock], placement: ExpertPlacement, group: InstanceGroup,
                 dispatcher: MoEDispatcher, dtype: torch.dtype):  # fmt: skip
        self.blocks = blocks
        self.dtype = dtype  # activations
        self.placement = placement
        self.group = group
        self.dispatcher = dispatcher

    @property
    def experts(self) -> list[FusedExperts]:
        return [b.experts for b in self.blocks]

    @torch.inference_mode()
    def dummy_forward(self) -> None:
        """Zero tokens through every MoE layer, in forward order: an idle rank enters each layer's
        collectives as the ranks with work do."""
        for block in self.blocks:
            w = block.gate.weight  # [E, H]
            block(torch.zeros(0, w.shape[1], dtype=self.dtype, device=w.device))

    def take_load(self) -> torch.Tensor:
        """[L, E] int64 on the experts' device: this rank's tokens per logical expert since the last
        call (resets). Stays on the device: no host sync per step."""
        device = self.blocks[0].gate.weight.device
        rows = []
        for block in self.blocks:
            run = block.ep
            rows.append(run.load if run.load is not None else torch.zeros(self.placement.num_experts,
                                                                           dtype=torch.int64, device=device))  # fmt: skip
            run.load = None
        return torch.stack(rows)


def moe_blocks(model: nn.Module) -> list[SparseMoeBlock]:
    """The model's MoE blocks in forward order (module registration order: layer order)."""
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


def apply_expert_parallel(model: nn.Module, group: InstanceGroup, dtype: torch.dtype, num_redundant: int = 0,
                          backend: Optional[str] = None, max_tokens: int = 0) -> ExpertParallel:  # fmt: skip
    """Shard `model`'s routed experts over `group` (before its checkpoint weights load; seeded
    weights may already be drawn: the rank's slices are kept). `backend`: the dispatch
    (`make_dispatcher`); `max_tokens`: the most tokens one forward carries (the padded dispatch's bound).

    Raises:
        ValueError: the model has no MoE layers, or the ranks cannot split its experts evenly.
    """
    blocks = moe_blocks(model)
    if not blocks:
        raise ValueError(f"expert_parallel_size={group.size} needs a mixture-of-experts model; "
                         f"{type(model).__name__} has no MoE layers")  # fmt: skip
    num_experts = blocks[0].routing.num_experts
    placement = ExpertPlacement.contiguous(len(blocks), num_experts, group.size, num_redundant)
    top_k = blocks[0].routing.top_k
    dispatcher = make_dispatcher(group, backend, max_tokens, top_k, placement.slots_per_rank)
    for layer, block in enumerate(blocks):
        shard_experts(block.experts, placement.local_experts(layer, group.rank))
        block.ep = ExpertParallelMoE(layer, placement, group, dispatcher)
    return ExpertParallel(blocks, placement, group, dispatcher, dtype)
