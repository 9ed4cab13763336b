"""One device's worker: loads the model, sizes and allocates the KV cache, runs steps."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

import torch

from deepinfer_core.config import EngineConfig
from deepinfer_core.worker.cache_engine import CacheEngine
from deepinfer_core.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from deepinfer_core.distributed.expert_parallel import ExpertParallel
    from deepinfer_core.distributed.group import InstanceGroup

logger = logging.getLogger(__name__)


class Worker:
    def __init__(self, config: EngineConfig, group: Optional[InstanceGroup] = None):
        """`group`: the instance's ranks, required with expert_parallel_size > 1."""
        from deepinfer_core.models.loader import load_model

        self.config = config
        self.device = torch.device(config.device)
        if self.device.type == "cuda":
            if self.device.index is None:  # 'cuda' means the current device; pin it so every tensor agrees
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
        self.ep: Optional[ExpertParallel] = None
        """Expert-parallel state of this rank (placement, load counters); None without EP."""
        self.model = load_model(
            config.model, self.device, self._expert_parallel_shard(group), self._expert_slots(group)
        )
        self.draft = None
        """The MTP draft layer, loaded only where the role drafts (`num_speculative_tokens` > 0)."""
        if config.scheduler.num_speculative_tokens > 0:
            from deepinfer_core.spec_decode.draft_model import load_mtp

            self.draft = load_mtp(config.model, self.device, self.model)
        self.runner = ModelRunner(config, self.model, self.device, self.ep)

    def _expert_parallel_shard(self, group: Optional[InstanceGroup]):
        """The loader's shard step of an expert-parallel rank, or None."""
        if not self._expert_parallel(group):
            return None
        ep_size = self.config.parallel.expert_parallel_size
        if group is None or group.size != ep_size:
            raise ValueError(f"expert_parallel_size={ep_size} needs the instance's group of {ep_size} ranks "
                             "(deepinfer_core.distributed.group.join_instance)")  # fmt: skip

        def shard(model) -> None:
            from deepinfer_core.distributed.expert_parallel import apply_expert_parallel

            self.ep = apply_expert_parallel(model, group, self.config.model.dtype, self.config.eplb.num_redundant_experts,
                                            self.config.parallel.moe_dispatch, self.config.scheduler.max_step_tokens)  # fmt: skip

        return shard

    def _expert_parallel(self, group: Optional[InstanceGroup]) -> bool:
        """EP ranks shard their experts; an instance of one rank (a group of size 1) takes the same
        path over itself: its dispatch, load counting and EPLB run as on N ranks."""
        return self.config.parallel.expert_parallel_size > 1 or (group is not None and group.size == 1)

    def _expert_slots(self, group: Optional[InstanceGroup]) -> Optional[list[int]]:
        """An expert-parallel rank's experts (before any rearrangement): all it builds and loads."""
        if not self._expert_parallel(group) or group is None:
            return None
        from deepinfer_core.distributed.placement import ExpertPlacement
        from deepinfer_core.models.hf_config import num_routed_experts

        return ExpertPlacement.initial_slots(num_routed_experts(self.config.model.hf_config), group.size,
                                             self.config.eplb.num_redundant_experts, group.rank)  # fmt: skip

    @property
    def num_draft_kv_layers(self) -> int:
        return self.draft.num_kv_cache_layers if self.draft is not None else 0

    @property
    def block_shape(self) -> tuple[int, ...]:
        return self.model.kv_cache_block_shape(self.config.cache.block_size)

    @property
    def bytes_per_block(self) -> int:
        layers = self.model.num_kv_cache_layers + self.num_draft_kv_layers
        return CacheEngine.bytes_per_block(layers, self.block_shape, self.config.model.dtype)

    def determine_num_blocks(self) -> int:
        """Fixed by config, else what fits after the role-shaped peak forward (device) or the CPU budget."""
        cache = self.config.cache
        if cache.num_gpu_blocks is not None:
            return cache.num_gpu_blocks
        if self.device.type != "cuda":
            return max(1, cache.cpu_kv_cache_bytes // self.bytes_per_block)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.runner.profile_run()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        used_by_others = total - free - torch.cuda.memory_reserved(self.device)
        available = total * cache.gpu_memory_utilization - peak - used_by_others
        num = int(available // self.bytes_per_block)
        if num < 1:
            raise ValueError(
                f"no device memory left for the KV cache (peak forward {peak / 2**30:.2f} GiB of "
                f"{total / 2**30:.2f} GiB); lower max_num_batched_tokens or raise gpu_memory_utilization"
            )
        return num

    def init_cache(self, num_blocks: int) -> CacheEngine:
        cache = CacheEngine(
            self.model.num_kv_cache_layers,
            self.block_shape,
            num_blocks,
            self.config.model.dtype,
            self.device,
            num_draft_layers=self.num_draft_kv_layers,
        )
        self.runner.cache = cache
        logger.info(
            "KV cache: %d blocks x %d tokens (%.1f MiB)",
            num_blocks,
            self.config.cache.block_size,
            num_blocks * self.bytes_per_block / 2**20,
        )
        if self.runner.use_cuda_graph:
            from deepinfer_core.worker.cuda_graph import DecodeGraphs, DraftGraphs

            self.runner.graphs = DecodeGraphs.capture(self.runner)
            if self.draft is not None:
                self.runner.draft_graphs = DraftGraphs.capture(self.runner, self.draft)
        if self.ep is not None:
            self.ep.take_load()  # the memory profile's rows are no expert load
        return cache
