"""Dispatch and combine of an expert-parallel MoE layer: the one interface a backend implements.

    dispatch(rows [N, H] sorted by physical slot, slot_counts [P]) -> Dispatched
        rows leave for the ranks owning their slots; what arrives is grouped by local slot
    combine(expert_out [M, H] in the dispatched order, handle) -> [N, H] in the sent order

`AllToAllDispatcher` does it with `torch.distributed.all_to_all_single` (gloo on CPU, NCCL on
GPU): the per-slot counts are exchanged first (one fixed-size all-to-all), which gives both
sides the split sizes and lets the receiver group rows by slot without any slot ids on the wire.
A DeepEP-style backend (fused, low-latency kernels) would implement the same two calls.

`PaddedAllToAllDispatcher` ("padded") trades bytes for static shapes: every rank sends every rank
a buffer of a fixed number of rows (the step's token bound times the most copies of one token one
rank can receive), so each call moves the same shapes with equal splits, the counts stay on the
device and nothing is read back to the host: the path a CUDA graph can capture for decode.
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
    hidden: torch.Tensor  # [M, H]: rows this rank computes, local slot 0's run first (then padding)
    counts: list[int] | torch.Tensor  # rows per local slot (S entries: a host copy, or on the device)
    handle: Any  # what `combine` needs to send the results back


class MoEDispatcher(ABC):
    comm_s: float = 0.0
    """Seconds spent in communication since creation (benchmarks read it)."""
    static_shapes: bool = False
    """Every call moves the same shapes and reads nothing back to the host: a decode step through
    it can be captured in a CUDA graph (`ModelRunner.use_cuda_graph`)."""

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


class PaddedAllToAllDispatcher(AllToAllDispatcher):
    """All-to-all with a fixed per-rank token bound: shapes never depend on the routing.

    A rank sends at most `max_tokens` tokens a step, each to k distinct experts, so at most
    `max_tokens * min(k, S)` of its rows go to one rank (S slots there, one copy per slot and
    token). Each rank's rows for rank d sit at the front of the d-th block of that many rows; one
    all-to-all with equal splits moves the blocks, and the receiver labels each row with its local
    slot from the exchanged counts (padding: slot S) and orders them by slot, padding last.
    """

    static_shapes = True

    def __init__(self, group: InstanceGroup, max_tokens: int, top_k: int, slots_per_rank: int):
        super().__init__(group)
        if max_tokens < 1:
            raise ValueError(f"the padded MoE dispatch needs a token bound >= 1, got {max_tokens}")
        self.max_rows = max_tokens * top_k
        """Most rows (token copies) one rank dispatches per call."""
        self.rows_per_peer = max_tokens * min(top_k, slots_per_rank)
        """Rows of each rank-to-rank block."""

    def dispatch(self, rows: torch.Tensor, slot_counts: torch.Tensor) -> Dispatched:
        n_rows, hidden = rows.shape
        if n_rows > self.max_rows:  # a shape, known on the host: no sync
            raise ValueError(f"{n_rows} token copies exceed the padded MoE dispatch's bound of {self.max_rows} "
                             "(max tokens per step x top-k)")  # fmt: skip
        N, B, device = self.group.size, self.rows_per_peer, rows.device
        send_counts = slot_counts.to(torch.int64).contiguous()  # [N*S], stays where the rows are
        recv_counts = torch.empty_like(send_counts)
        self._all_to_all(recv_counts, send_counts)  # recv_counts[s*S + j]: rows source s sends my slot j
        S = send_counts.numel() // N
        per_peer = send_counts.view(N, S).sum(1)  # [N] rows for each rank
        peer = torch.repeat_interleave(torch.arange(N, device=device), per_peer, output_size=n_rows)
        first = per_peer.cumsum(0) - per_peer  # [N] row index of each rank's first row
        at = peer * B + torch.arange(n_rows, device=device) - first[peer]  # [n_rows] place in the send buffer
        send = rows.new_zeros(N * B, hidden).index_copy_(0, at, rows)
        arrived = torch.empty_like(send)
        self._all_to_all(arrived, send)
        ends = recv_counts.view(N, S).cumsum(1)  # [N, S] end of each slot's run in each source's block
        place = torch.arange(B, device=device).expand(N, B).contiguous()
        labels = torch.searchsorted(ends, place, right=True).reshape(-1)  # [N*B] local slot; S: padding
        order = torch.argsort(labels, stable=True)  # by slot, sources in order, padding last
        counts = recv_counts.view(N, S).sum(0)  # not `bincount`: on CUDA it reads its input's max back
        return Dispatched(arrived[order], counts, (order, at))

    def combine(self, expert_out: torch.Tensor, handle: Any) -> torch.Tensor:
        order, at = handle
        by_source = torch.empty_like(expert_out)
        by_source[order] = expert_out
        back = torch.empty_like(by_source)
        self._all_to_all(back, by_source)
        return back.index_select(0, at)


MOE_DISPATCH_BACKENDS = ("all_to_all", "padded")


def make_dispatcher(group: InstanceGroup, backend: Optional[str] = None, max_tokens: int = 0, top_k: int = 1,
                    slots_per_rank: int = 1) -> MoEDispatcher:  # fmt: skip
    """The dispatcher backend by name: "all_to_all" (counts first, rows exactly as routed) or
    "padded" (a fixed bound of `max_tokens` tokens per rank and step: static shapes)."""
    if backend in (None, "all_to_all"):
        return AllToAllDispatcher(group)
    if backend == "padded":
        return PaddedAllToAllDispatcher(group, max_tokens, top_k, slots_per_rank)
    raise ValueError(f"unknown MoE dispatch backend {backend!r}; available: {', '.join(MOE_DISPATCH_BACKENDS)}")
