"""The balancer of one expert-parallel rank: counts load, rearranges on the role's schedule.

After each schedule the engine calls `on_step(scheduler.expert_balance_steps)`. That counter
advances only on the steps the role lets count (SPEC §1: PE and CE every step; NORMAL not on a
prefill step nor the one right after), and it advances identically on every rank (the ranks take
the same step kinds), so every rank reaches each measurement and rearrangement at the same step
without asking: the collectives stay aligned.

- every `measure_interval` counted steps: all-reduce the load since the last rearrangement and
  update the `imbalance` gauge (max / mean tokens per rank under the current placement);
- every `interval` counted steps (when enabled): also compute a new placement with the policy,
  move the weights (`rearrange.move_experts`, between two steps: traffic pauses for one step at
  most) and start a new load window. Weights and maps are rewritten in their own storage, so
  the decode graphs captured before keep replaying, now over the new placement.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from deepinfer_core.config import EplbConfig
from deepinfer_core.distributed.expert_parallel import ExpertParallel
from deepinfer_core.distributed.placement import imbalance
from deepinfer_core.eplb.policy import rebalance
from deepinfer_core.eplb.rearrange import move_experts
from deepinfer_core.roles import RoleProfile

logger = logging.getLogger(__name__)


class ExpertBalancer:
    def __init__(self, ep: ExpertParallel, config: EplbConfig, role: RoleProfile):
        self.ep = ep
        self.enabled = config.enabled
        self.interval = config.rearrange_interval or role.eplb_interval
        self.measure_interval = min(config.measure_interval, self.interval)
        self.policy = config.policy or role.eplb_policy
        nodes = ep.group.size // config.ranks_per_node if config.ranks_per_node else 1
        self.num_nodes = max(1, nodes)
        self.num_groups = ep.blocks[0].routing.n_group
        device = ep.blocks[0].gate.weight.device  # counted where the routing runs: no host sync per step
        self.window = torch.zeros(ep.placement.num_layers, ep.placement.num_experts, dtype=torch.int64, device=device)
        """[L, E] this rank's tokens per logical expert since the last rearrangement (on the device)."""
        self._seen_steps = 0
        self.num_rearrangements = 0
        self.imbalance: Optional[float] = None
        """The last measured max / mean tokens per rank (None before the first measurement)."""
        self.last_move: dict = {}

    def on_step(self, balance_steps: int) -> bool:
        """After a schedule; True when this step rearranged the experts."""
        counted, self._seen_steps = balance_steps != self._seen_steps, balance_steps
        self.window += self.ep.take_load()
        if not counted or balance_steps % self.measure_interval:
            return False
        load = self.ep.group.all_reduce(self.window.to("cpu", copy=True))  # [L, E] over the instance
        self.imbalance = imbalance(self.ep.placement.rank_load(load))
        if not self.enabled or balance_steps % self.interval:
            return False
        self.rearrange(load)
        return True

    def rearrange(self, load: torch.Tensor) -> None:
        """Move to the policy's placement for `load` ([L, E], the whole instance's)."""
        placement = self.ep.placement
        new = rebalance(load, placement.num_slots, placement.num_ranks, self.policy, self.num_groups, self.num_nodes)
        before = self.imbalance if self.imbalance is not None else imbalance(placement.rank_load(load))
        self.last_move = move_experts(self.ep.experts, placement.phy2log, new, self.ep.group)
        placement.update(new)  # the same map tensors: a captured graph routes by the new placement
        self.imbalance = imbalance(placement.rank_load(load))
        self.window.zero_()
        self.num_rearrangements += 1
        logger.info("EPLB (%s): imbalance %.3f -> %.3f, %d experts received in %.3f s", self.policy, before,
                    self.imbalance, self.last_move["received"], self.last_move["seconds"])  # fmt: skip
