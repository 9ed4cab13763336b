"""Dispatch and combine of an expert-parallel MoE layer: the one interface a backend implements.

    dispatch(rows [N, H] sorted by physical slot, slot_counts [P]) -> Dispatched
        rows leave for the ranks owning their slots; what arrives is grouped by local slot
    combine(expert_out [M, H] in the dispatched order, handle) -> [N, H] in the sent order

`AllToAllDispatcher` does it with `torch.distributed.all_to_all_single` (gloo on CPU, NCCL on
GPU): the per-slot counts are exchanged first (one fixed-size all-to-all), which gives both
sides the split sizes and lets the receiver group rows by slot without any slot ids on the wire.
A DeepEP-style backend (fused, low-latency kernels) would implement the same two calls.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from deepinfer_core.distributed.group import InstanceFailed, InstanceGroup


@dataclass
class Dispatched:
    hidden: torch.Tensor  # [M, H]: rows this rank computes, local slot 0's run first
    counts: list[int]  # rows per local slot (S entries, host copy)
    handle: Any  # what `combine` needs to send the results back


class MoEDispatcher(ABC):
    comm_s: float = 0.0
    """Seconds spent in communication since creation (benchmarks read it)."""

    @abstractmethod
    def dispatch(self, rows: torch.Tensor, slot_counts: torch.Tensor) -> Dispatched:
        """Send each row to the rank owning its physical slot.

        Args:
            rows: [N, H] token copies sorted by physical slot.
            slot_counts: [P] int64, rows per physical slot (sums to N).
        """

    @abstractmethod
    def combine(self, expert_out: torch.Tensor, handle: Any) -> torch.Tensor:
        """Return expert outputs ([M, H], dispatched order) to their sources: [N, H] in sent order."""


class AllToAllDispatcher(MoEDispatcher):
    def __init__(self, group: InstanceGroup):
        self.group = group
        self.comm_s = 0.0

    def _all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits=None, in_splits=None) -> None:
        start = time.perf_counter()
        try:
            dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group.pg)
        except RuntimeError as e:
            raise InstanceFailed(f"rank {self.group.rank}/{self.group.size}: MoE all-to-all failed: {e}") from e
        finally:
            self.comm_s += time.perf_counter() - start

    def dispatch(self, rows: torch.Tensor, slot_counts: torch.Tensor) -> Dispatched:
        N = self.group.size
        send = slot_counts.to(torch.int64).cpu().contiguous()  # [N*S]: rank d's slots are the d-th run
        recv = torch.empty_like(send)
        self._all_to_all(recv, send)  # recv[s*S + j]: rows source s sends for my slot j
        S = send.numel() // N
        send_splits = send.view(N, S).sum(1).tolist()
        recv_splits = recv.view(N, S).sum(1).tolist()
        arrived = rows.new_empty(sum(recv_splits), rows.shape[1])
        self._all_to_all(arrived, rows.contiguous(), recv_splits, send_splits)
        # arrived rows run by source, each source's by slot: regroup by slot, sources in order
        labels = torch.arange(S).repeat(N).repeat_interleave(recv)  # [M] local slot of each row
        order = torch.argsort(labels, stable=True).to(rows.device)
        counts = recv.view(N, S).sum(0).tolist()
        return Dispatched(arrived[order], counts, (order, send_splits, recv_splits))

    def combine(self, expert_out: torch.Tensor, handle: Any) -> torch.Tensor:
        order, send_splits, recv_splits = handle
        by_source = torch.empty_like(expert_out)
        by_source[order] = expert_out
        back = expert_out.new_empty(sum(send_splits), expert_out.shape[1])
        self._all_to_all(back, by_source, send_splits, recv_splits)
        return back


def make_dispatcher(group: InstanceGroup, backend: Optional[str] = None) -> MoEDispatcher:
    """The dispatcher backend by name; "all_to_all" is the only one so far."""
    if backend in (None, "all_to_all"):
        return AllToAllDispatcher(group)
    raise ValueError(f"unknown MoE dispatch backend {backend!r}; available: all_to_all")
