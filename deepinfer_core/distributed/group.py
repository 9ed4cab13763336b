"""The process group of one engine instance, joined with a deadline.

Every rank of an instance (one process per device, or per CPU process) calls `join_instance`.
Rank 0 hosts a TCP store at `address`; each rank announces itself under `joined/<rank>` and waits
for the others until `join_timeout_s`: a rank that never comes is named in the error, so the
host can fail the whole instance with a useful message instead of hanging in
`init_process_group`. The group's collectives carry `collective_timeout_s` (gloo raises after it;
`lockstep.StepWatchdog` is the backstop where a backend would block).
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


class InstanceFailed(RuntimeError):
    """A rank of the instance is gone or a collective broke: the whole instance is unusable."""


@dataclass
class InstanceGroup:
    """One rank's view of its instance: rank, size and the process group the collectives use."""

    rank: int
    size: int
    pg: Optional[dist.ProcessGroup] = None
    """None: the default (world) group."""
    collective_timeout_s: float = 60.0
    store: Optional[dist.Store] = None
    """The instance's rendezvous store (rank 0 hosts it); `lockstep.PeerMonitor` beats through it."""
    cpu_pg: Optional[dist.ProcessGroup] = None
    """A gloo group over the same ranks for host-side control (beats, DP votes, load counts) when
    `pg` is NCCL; None: `pg` takes CPU tensors already."""

    @property
    def control_pg(self) -> Optional[dist.ProcessGroup]:
        """The group for small CPU-tensor collectives."""
        return self.cpu_pg if self.cpu_pg is not None else self.pg

    def any(self, flag: bool) -> bool:
        """Whether any rank passed True (one small all-reduce: the lockstep beat)."""
        t = torch.tensor([1 if flag else 0], dtype=torch.int64)
        self.all_reduce(t, dist.ReduceOp.MAX)
        return bool(t.item())

    def all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """In-place all-reduce of a CPU tensor (over `control_pg`); a broken peer raises InstanceFailed."""
        try:
            dist.all_reduce(t, op=op, group=self.control_pg)
        except RuntimeError as e:
            raise InstanceFailed(f"rank {self.rank}/{self.size}: all-reduce failed: {e}") from e
        return t

    def gather(self, obj) -> list:
        """Every rank's `obj` (picklable), in rank order (over `control_pg`)."""
        out: list = [None] * self.size
        try:
            dist.all_gather_object(out, obj, group=self.control_pg)
        except RuntimeError as e:
            raise InstanceFailed(f"rank {self.rank}/{self.size}: all-gather failed: {e}") from e
        return out

    @classmethod
    def subgroup(cls, ranks: list[int], collective_timeout_s: float = 60.0) -> InstanceGroup:
        """An instance over some ranks of the world (call on every world rank, members or not);
        for tests running several instances in one world. Non-members get rank -1."""
        pg = dist.new_group(ranks, timeout=datetime.timedelta(seconds=collective_timeout_s))
        me = dist.get_rank()
        return cls(ranks.index(me) if me in ranks else -1, len(ranks), pg, collective_timeout_s)


def _wait_for_ranks(store: dist.Store, rank: int, size: int, timeout_s: float) -> None:
    """Block until every rank announced itself; TimeoutError naming the missing ones."""
    deadline = time.monotonic() + timeout_s
    pending = set(range(size))
    while pending:
        try:
            pending = {r for r in pending if not store.check([f"joined/{r}"])}
        except dist.DistError as e:  # the store's host (rank 0) gave up first
            raise TimeoutError(f"rank {rank}: rank(s) {sorted(pending)} of {size} did not join the instance "
                               f"(rank 0 stopped waiting: {type(e).__name__})") from None  # fmt: skip
        if not pending:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"rank {rank}: rank(s) {sorted(pending)} of {size} did not join the instance within {timeout_s:.0f} s"
            )
        time.sleep(0.02)


def join_instance(
    rank: int,
    size: int,
    address: str,
    backend: str = "gloo",
    join_timeout_s: float = 60.0,
    collective_timeout_s: float = 60.0,
) -> InstanceGroup:
    """Join (as the default group of this process) the instance of `size` ranks at "host:port".

    Raises:
        TimeoutError: some rank did not join within `join_timeout_s` (the message names it).
    """
    host, port = address.rsplit(":", 1)
    store = dist.TCPStore(
        host, int(port), size, is_master=rank == 0, timeout=datetime.timedelta(seconds=join_timeout_s),
        wait_for_workers=False,
    )  # fmt: skip
    store.set(f"joined/{rank}", "1")
    _wait_for_ranks(store, rank, size, join_timeout_s)
    timeout = datetime.timedelta(seconds=collective_timeout_s)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    cpu_pg = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
    return InstanceGroup(rank, size, None, collective_timeout_s, store, cpu_pg)


def leave_instance() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
