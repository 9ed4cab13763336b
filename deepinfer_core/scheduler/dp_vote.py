"""The step-kind vote of NORMAL engines with data parallelism (SPEC §3).

DP-attention ranks share MoE all-to-all collectives, so every rank must take the same
step kind. Vote points, counted in decode steps since the last prefill step:
- ALL point every `prefill_attempt_interval` steps: prefill only if every rank wants to
  (MIN over want?1:0) — no rank idles through an empty prefill for one busy rank;
- ANY point every `prefill_any_attempt_interval` steps: prefill if any rank wants to
  (MIN over want?0:1) — a lone request on one rank cannot starve.
A second vote asks whether any rank actually scheduled a prefill: none means everyone
decodes (otherwise full KV + non-empty waiting would loop on empty prefill steps);
some means a rank with nothing runs an empty prefill step to keep the collectives aligned.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
import torch.distributed as dist

from deepinfer_core import envs
from deepinfer_core.scheduler.outputs import SchedulerOutputs


class DPVote:
    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        prefill_attempt_interval: int | None = None,
        prefill_any_attempt_interval: int | None = None,
    ):
        self.group = group
        self.all_interval = prefill_attempt_interval or envs.DEEPINFER_PREFILL_ATTEMPT_INTERVAL
        self.any_interval = prefill_any_attempt_interval or envs.DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL
        if self.all_interval < 1 or self.any_interval < 1:
            raise ValueError("prefill attempt intervals must be >= 1")
        self.num_votes = 0  # all-reduces issued (observable in tests)

    def _allreduce_min(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        self.num_votes += 1
        return int(t.item())

    def schedule(
        self,
        decode_step: int,
        wants_prefill: Callable[[], bool],
        prefill: Callable[[], Optional[SchedulerOutputs]],
        decode: Callable[[], SchedulerOutputs],
    ) -> SchedulerOutputs:
        """This rank's step, of the kind every rank takes.

        Args:
            decode_step: decode steps since this rank's last prefill step (where the vote points are).
            wants_prefill: whether this rank has prefill work it can take (asked at vote points only).
            prefill: builds this rank's prefill step; None when nothing could be scheduled.
            decode: builds this rank's decode step.
        """
        is_any_point = decode_step != 0 and decode_step % self.any_interval == 0
        is_all_point = decode_step % self.all_interval == 0
        if not is_any_point and not is_all_point:
            return decode()
        want = wants_prefill()
        if is_any_point:
            do_prefill = self._allreduce_min(0 if want else 1) == 0
        else:
            do_prefill = self._allreduce_min(1 if want else 0) == 1
        if not do_prefill:
            return decode()
        out = prefill() if want else None
        any_scheduled = self._allreduce_min(0 if out is not None else 1) == 0
        if not any_scheduled:
            return decode()
        if out is not None:
            return out
        return SchedulerOutputs(prompt_run=True)  # keep step kinds aligned across ranks
