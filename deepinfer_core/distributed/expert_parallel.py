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

What a captured decode graph reads lives in fixed storage made before the capture: the load
counter (`ExpertParallel.load`, accumulated in place, read and reset between steps), the
placement's device maps (`ExpertPlacement.place_on`, rewritten in place by a rearrangement) and
the expert weights (moved slot by slot into the same parameters, `eplb.rearrange`).
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


NO_ROW_LIMIT = 2**62
"""`ExpertParallel.num_real` outside a captured graph's replay: every row is a real token."""


class ExpertParallelMoE:
    """The routed experts of MoE layer `layer` over the instance (set as `SparseMoeBlock.ep`)."""

    def __init__(self, layer: int, placement: ExpertPlacement, group: InstanceGroup, dispatcher: MoEDispatcher,
                 load: torch.Tensor, num_real: torch.Tensor):  # fmt: skip
        self.layer = layer
        self.placement = placement
        self.group = group
        self.dispatcher = dispatcher
        self.load = load
        """[E] int64, a row of `ExpertParallel.load`: this rank's tokens routed to each logical expert."""
        self.num_real = num_real
        """[1] int64 (`ExpertParallel.num_real`): rows past it are a captured graph's padding."""

    def __call__(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: FusedExperts
    ) -> torch.Tensor:
        T, k = ids.shape  # x: [T, H], weights/ids: [T, k]
        flat_ids = ids.reshape(-1)  # [T*k] logical
        token_of = torch.arange(T, device=x.device).repeat_interleave(k)  # [T*k]
        self._count(flat_ids, token_of)
        phys = self.placement.to_physical(self.layer, ids, self.group.rank).reshape(-1)  # [T*k]
        order = torch.argsort(phys, stable=True)
        slot_counts = count_ids(phys, self.placement.num_slots)
        sent = self.dispatcher.dispatch(x[token_of[order]], slot_counts)
        empty = torch.empty(0, dtype=torch.int64, device=x.device)
        y = experts(PermutedTokens(sent.hidden, empty, empty.float(), sent.counts))  # [M, H]
        back = torch.empty(T * k, x.shape[1], dtype=y.dtype, device=x.device)
        back[order] = self.dispatcher.combine(y, sent.handle)  # [T*k, H] in (token, j) order
        return weighted_sum(back, weights, ids, y.dtype)

    def _count(self, flat_ids: torch.Tensor, token_of: torch.Tensor) -> None:
        """Add the real tokens' expert ids to `load`, in place (no new tensor survives the step)."""
        real = (token_of < self.num_real).to(torch.int64)  # a graph's padding rows count 0
        self.load.scatter_add_(0, flat_ids, real)


def weighted_sum(back: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[T*k, H] expert outputs in (token, j) order -> [T, H]: each token's terms, weighted and
    rounded to `dtype`, added in ascending expert id in float32 and rounded once, which is what the
    single-rank layer's `index_add_` does on CPU. One add per j instead of `index_add_`: on a GPU
    that scatters with bf16 atomics, rounding after each add in no fixed order, so an EP layer's
    output (and a captured graph's replay of it) would differ from run to run."""
    T, k = ids.shape
    terms = (back * weights.reshape(-1, 1)).to(dtype).view(T, k, back.shape[1])
    in_expert_order = torch.argsort(ids, dim=1, stable=True)
    terms = terms.gather(1, in_expert_order[:, :, None].expand(-1, -1, back.shape[1]))
    out = torch.zeros(T, back.shape[1], dtype=torch.float32, device=back.device)
    for j in range(k):
        out += terms[:, j]
    return out.to(dtype)


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
        device = blocks[0].gate.weight.device  # where the routing runs: counted there, no host sync per step
        placement.place_on(device)
        self.load = torch.zeros(placement.num_layers, placement.num_experts, dtype=torch.int64, device=device)
        """[L, E] int64: this rank's tokens per logical expert since `take_load` (added to in place)."""
        self.num_real = torch.full((1,), NO_ROW_LIMIT, dtype=torch.int64, device=device)
        """[1] int64: how many leading rows of the running forward are real tokens (a captured decode
        graph sets it before each replay; its padding rows are routed and dispatched, never counted)."""

    @property
    def experts(self) -> list[FusedExperts]:
        return [b.experts for b in self.blocks]

    @property
    def capturable(self) -> bool:
        """Whether a decode step can be captured in a CUDA graph: the dispatch has static shapes
        and keeps its counts on the device (the exact-count all-to-all reads them back)."""
        return self.dispatcher.static_shapes

    @torch.inference_mode()
    def dummy_forward(self) -> None:
        """Zero tokens through every MoE layer, in forward order: an idle rank enters each layer's
        collectives as the ranks with work do."""
        for block in self.blocks:
            w = block.gate.weight  # [E, H]
            block(torch.zeros(0, w.shape[1], dtype=self.dtype, device=w.device))

    def take_load(self) -> torch.Tensor:
        """[L, E] int64 on the experts' device: this rank's tokens per logical expert since the last
        call; the counter is zeroed in place. Between steps, never inside a captured region; stays on
        the device: no host sync."""
        taken = self.load.clone()
        self.load.zero_()
        return taken


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
    ep = ExpertParallel(blocks, placement, group, dispatcher, dtype)
    for layer, block in enumerate(blocks):
        shard_experts(block.experts, placement.local_experts(layer, group.rank))
        block.ep = ExpertParallelMoE(layer, placement, group, dispatcher, ep.load[layer], ep.num_real)
    return ep
