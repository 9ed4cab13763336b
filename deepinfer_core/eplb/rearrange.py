"""Moving expert weights to a new placement: one all-to-all of raw bytes per MoE layer.

Every rank knows the old and the new `phy2log`, so every rank derives the same transfer plan
without asking anyone: a new slot whose expert the rank already holds is a local copy; any other
is sent by the lowest rank holding that expert in the old placement. A slot's tensors (w13, w2,
FP8 factors where present) travel as one row of bytes, so one collective per layer carries
every dtype. All ranks enter every layer's all-to-all, moves or not: collectives stay aligned.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from deepinfer_core.distributed.group import InstanceFailed, InstanceGroup
from deepinfer_core.models.layers.moe import FusedExperts


def plan_layer(old: list[int], new: list[int], num_ranks: int) -> list[tuple[int, int, int]]:
    """(source rank, destination rank, destination slot index) of each expert that must move."""
    S = len(old) // num_ranks
    holders: dict[int, list[int]] = {}
    for p, e in enumerate(old):
        holders.setdefault(e, []).append(p // S)
    moves = []
    for d in range(num_ranks):
        held = set(old[d * S : (d + 1) * S])
        for j, e in enumerate(new[d * S : (d + 1) * S]):
            if e not in held:
                moves.append((min(holders[e]), d, j))
    return moves


def _slot_bytes(experts: FusedExperts, slot: int) -> torch.Tensor:
    """[B] uint8: every stacked tensor's slice for `slot`, as raw bytes."""
    parts = [p.data[slot].contiguous().view(-1).view(torch.uint8) for _, p in experts.named_parameters(recurse=False)]
    return torch.cat(parts)


def _load_slot(experts: FusedExperts, slot: int, row: torch.Tensor) -> None:
    """Inverse of `_slot_bytes`."""
    at = 0
    for _, p in experts.named_parameters(recurse=False):
        view = p.data[slot]
        n = view.numel() * view.element_size()
        view.copy_(row[at : at + n].view(view.dtype).view(view.shape))
        at += n


def move_layer(experts: FusedExperts, old: list[int], new: list[int], group: InstanceGroup) -> int:
    """Make this rank's slots hold `new`'s experts (in place); returns the experts it received."""
    me, N = group.rank, group.size
    S = len(old) // N
    moves = plan_layer(old, new, N)
    mine_old = old[me * S : (me + 1) * S]
    row_bytes = _slot_bytes(experts, 0).numel()
    device = experts.w2_weight.device
    sends = [[mine_old.index(new[d * S + j]) for s, d, j in moves if s == me and d == dst] for dst in range(N)]
    send = torch.stack([_slot_bytes(experts, i) for per in sends for i in per]) if any(sends) else None
    recv_slots = [[j for s, d, j in moves if d == me and s == src] for src in range(N)]
    recv = torch.empty(sum(len(r) for r in recv_slots), row_bytes, dtype=torch.uint8, device=device)
    send = send if send is not None else torch.empty(0, row_bytes, dtype=torch.uint8, device=device)
    try:
        dist.all_to_all_single(recv, send, [len(r) for r in recv_slots], [len(s) for s in sends], group=group.pg)
    except RuntimeError as e:
        raise InstanceFailed(f"rank {me}/{N}: expert rearrangement failed: {e}") from e
    kept = {
        j: _slot_bytes(experts, mine_old.index(e)) for j, e in enumerate(new[me * S : (me + 1) * S]) if e in mine_old
    }
    arrived = dict(zip([j for per in recv_slots for j in per], recv))
    for j, row in {**kept, **arrived}.items():  # `kept` rows are copies: overwriting a slot is safe
        _load_slot(experts, j, row)
    experts.local_experts = new[me * S : (me + 1) * S]
    return len(arrived)


def move_experts(experts: list[FusedExperts], old: torch.Tensor, new: torch.Tensor, group: InstanceGroup) -> dict:
    """Every MoE layer to the new placement ([L, P] each); what moved and how long it took."""
    start = time.perf_counter()
    received = sum(move_layer(m, o, n, group) for m, o, n in zip(experts, old.tolist(), new.tolist(), strict=True))
    return {"received": received, "seconds": time.perf_counter() - start}
