"""Where each expert lives: logical experts (the router's ids) on physical slots on ranks.

An instance of N ranks has P = E + R physical expert slots per MoE layer (R redundant ones, for
hot experts), S = P / N per rank, rank r owning slots [r*S, (r+1)*S). Per MoE layer l:

    phy2log [L, P]         logical expert held by each physical slot
    logcnt  [L, E]         replicas of each logical expert (>= 1)
    log2phy [L, E, R+1]    the physical slots of each logical expert, -1 padded (R+1: the most
                           replicas one expert can have, so the shape never changes)

The initial placement is contiguous (slot p holds expert p mod E): rank r holds experts
[r*E/N, (r+1)*E/N) when there is no redundancy. EPLB (`deepinfer_core/eplb/`) replaces it with
`update`, which writes the new maps into the same tensors, host and device copies alike: a CUDA
graph captured over the device maps (`place_on`) routes by the new placement at its next replay.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def check_expert_parallel(num_experts: int, ep_size: int, num_redundant: int = 0) -> None:
    """ValueError when `ep_size` ranks cannot hold `num_experts` experts plus `num_redundant` slots."""
    if ep_size <= 1 and num_redundant == 0:
        return
    if num_experts == 0:
        raise ValueError(
            f"expert_parallel_size={ep_size} needs a mixture-of-experts model; this model has no routed experts"
        )
    if num_redundant < 0:
        raise ValueError(f"num_redundant_experts must be >= 0, got {num_redundant}")
    slots = num_experts + num_redundant
    if ep_size > slots or slots % ep_size:
        extra = f" plus {num_redundant} redundant slots" if num_redundant else " (without redundant experts)"
        raise ValueError(
            f"expert_parallel_size={ep_size} must divide the {num_experts} routed experts{extra} "
            f"and not exceed them ({slots} slots cannot be split evenly over {ep_size} ranks)"
        )


@dataclass
class ExpertPlacement:
    phy2log: torch.Tensor  # [L, P] int64
    num_experts: int
    num_ranks: int

    def __post_init__(self) -> None:
        L, P = self.phy2log.shape
        self.logcnt = torch.zeros(L, self.num_experts, dtype=torch.int64)
        self.log2phy = torch.full((L, self.num_experts, P - self.num_experts + 1), -1, dtype=torch.int64)
        self._on_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # (logcnt, log2phy) copies
        self.refresh()

    @classmethod
    def contiguous(cls, num_layers: int, num_experts: int, num_ranks: int, num_redundant: int = 0) -> ExpertPlacement:
        check_expert_parallel(num_experts, num_ranks, num_redundant)
        row = torch.arange(num_experts + num_redundant) % num_experts
        return cls(row.repeat(num_layers, 1), num_experts, num_ranks)

    @staticmethod
    def initial_slots(num_experts: int, num_ranks: int, num_redundant: int, rank: int) -> list[int]:
        """Logical expert of each of `rank`'s slots in the contiguous placement (every MoE layer's
        until a rearrangement): what the rank builds and loads, before any placement exists."""
        check_expert_parallel(num_experts, num_ranks, num_redundant)
        per_rank = (num_experts + num_redundant) // num_ranks
        return [(rank * per_rank + i) % num_experts for i in range(per_rank)]

    def refresh(self) -> None:
        """Derive `logcnt` and `log2phy` from `phy2log`, in place (and into every device copy)."""
        L, P = self.phy2log.shape
        logcnt = torch.zeros_like(self.logcnt).scatter_add_(1, self.phy2log, torch.ones_like(self.phy2log))
        if int(logcnt.min()) < 1:
            raise ValueError("a placement must hold every logical expert at least once")
        log2phy = torch.full_like(self.log2phy, -1)
        seen = torch.zeros(L, self.num_experts, dtype=torch.int64)
        for layer in range(L):
            for p, e in enumerate(self.phy2log[layer].tolist()):
                log2phy[layer, e, seen[layer, e]] = p
                seen[layer, e] += 1
        self.logcnt.copy_(logcnt)
        self.log2phy.copy_(log2phy)
        for dev_logcnt, dev_log2phy in self._on_device.values():  # stream-ordered behind a step still in flight
            dev_logcnt.copy_(self.logcnt)
            dev_log2phy.copy_(self.log2phy)

    def update(self, phy2log: torch.Tensor) -> None:
        """Move to a new placement ([L, P], same shape): every map keeps its storage."""
        if phy2log.shape != self.phy2log.shape:
            raise ValueError(f"a new placement must keep the shape {tuple(self.phy2log.shape)}, "
                             f"got {tuple(phy2log.shape)}")  # fmt: skip
        old = self.phy2log.clone()
        self.phy2log.copy_(phy2log)
        try:
            self.refresh()
        except ValueError:
            self.phy2log.copy_(old)
            raise

    def place_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The (logcnt, log2phy) copies `to_physical` reads on `device`, made once: before a CUDA
        graph captures them, after which `update` only ever writes into them."""
        device = torch.device(device)
        if device not in self._on_device:
            self._on_device[device] = (self.logcnt.to(device, copy=True), self.log2phy.to(device, copy=True))
        return self._on_device[device]

    @property
    def num_layers(self) -> int:
        return self.phy2log.shape[0]

    @property
    def num_slots(self) -> int:
        return self.phy2log.shape[1]

    @property
    def slots_per_rank(self) -> int:
        return self.num_slots // self.num_ranks

    def local_experts(self, layer: int, rank: int) -> list[int]:
        """Logical expert of each of `rank`'s slots, in slot order."""
        S = self.slots_per_rank
        return self.phy2log[layer, rank * S : (rank + 1) * S].tolist()

    def to_physical(self, layer: int, ids: torch.Tensor, rank: int) -> torch.Tensor:
        """[T, k] logical ids -> [T, k] physical slots. A token spreads over an expert's replicas by
        its position (offset by rank, so that ranks do not all pick the first replica)."""
        logcnt, log2phy = self.place_on(ids.device)
        cnt = logcnt[layer][ids]  # [T, k]
        pos = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1) + rank
        return log2phy[layer][ids, pos % cnt]

    def rank_load(self, load: torch.Tensor) -> torch.Tensor:
        """[L, E] logical load -> [L, N] tokens per rank, a replicated expert's load split evenly."""
        per_slot = load.double().gather(1, self.phy2log) / self.logcnt.double().gather(1, self.phy2log)
        return per_slot.view(self.num_layers, self.num_ranks, self.slots_per_rank).sum(-1)


def imbalance(rank_load: torch.Tensor) -> float:
    """max / mean tokens per rank, averaged over layers (1.0 is perfect balance)."""
    mean = rank_load.mean(-1).clamp_min(1e-9)
    return float((rank_load.max(-1).values / mean).mean())
