"""CUDA graphs for decode steps (NORMAL and COMPLETION roles; never PROMPT, SPEC §1).

One graph per batch-size bucket, captured over static input buffers and a block-table
width that covers max_model_len. A step of B sequences runs the smallest bucket >= B:
padded rows write their K/V into the cache's scratch block and their outputs are dropped.
"""

from __future__ import annotations

import gc
import logging
from typing import TYPE_CHECKING

import torch

from deepinfer_core.models.layers.attention import AttentionMetadata

if TYPE_CHECKING:
    from deepinfer_core.worker.input_batch import ModelInput
    from deepinfer_core.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def batch_buckets(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16))
    top = min(max_num_seqs, 256)
    return [s for s in sizes if s < top] + [top]


class DecodeGraphs:
    def __init__(self, runner: ModelRunner):
        self.runner = runner
        cache = runner.cache
        self.block_size = runner.block_size
        self.width = (runner.config.scheduler.max_model_len + self.block_size - 1) // self.block_size
        self.buckets = batch_buckets(runner.config.scheduler.max_num_seqs)
        n, dev = self.buckets[-1], runner.device
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n,), cache.scratch_block * self.block_size, dtype=torch.int64, device=dev)
        self.block_tables = torch.full((n, self.width), cache.scratch_block, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    @classmethod
    def capture(cls, runner: ModelRunner) -> DecodeGraphs:
        self = cls(runner)
        pool = torch.cuda.graph_pool_handle()
        # Nothing but the forward may touch CUDA while a graph is captured. A garbage collection
        # in the middle would free pinned host buffers of earlier steps, and the pinned allocator
        # then queries their events: an illegal call that invalidates the capture. So collect
        # first and keep the collector off; "thread_local" lets other threads (a NIXL progress
        # thread) make their own CUDA calls meanwhile.
        gc.collect()
        gc_was_on = gc.isenabled()
        gc.disable()
        try:
            for bs in reversed(self.buckets):  # largest first: smaller graphs reuse its memory
                self._forward(bs)  # warm up (allocator, kernels' autotuning) outside the graph
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    self.outputs[bs] = self._forward(bs)
                self.graphs[bs] = graph
        finally:
            if gc_was_on:
                gc.enable()
        torch.cuda.synchronize()
        logger.info("captured decode CUDA graphs for batch sizes %s", self.buckets)
        return self

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            block_tables=self.block_tables[:bs],
            query_start_loc=torch.arange(bs + 1, dtype=torch.int32, device=self.runner.device),
            seq_lens=self.seq_lens[:bs],
            query_lens_cpu=[1] * bs,
            seq_lens_cpu=[],  # unused on the static path
            is_decode_only=True,
            static_shapes=True,
        )

    @torch.inference_mode()
    def _forward(self, bs: int) -> torch.Tensor:
        model = self.runner.model
        return model(self.input_ids[:bs], self.positions[:bs], self.runner.cache.kv_caches, self._meta(bs))

    def can_run(self, inp: ModelInput) -> bool:
        b = inp.input_ids.shape[0]
        return b <= self.buckets[-1] and inp.attn_meta.block_tables.shape[1] <= self.width

    def run(self, inp: ModelInput) -> torch.Tensor:
        b = inp.input_ids.shape[0]
        bs = next(s for s in self.buckets if s >= b)
        scratch = self.runner.cache.scratch_block
        self.input_ids[:b].copy_(inp.input_ids)
        self.positions[:b].copy_(inp.positions)
        self.slot_mapping[:b].copy_(inp.attn_meta.slot_mapping)
        self.slot_mapping[b:bs].fill_(scratch * self.block_size)
        w = inp.attn_meta.block_tables.shape[1]
        self.block_tables[:b, :w].copy_(inp.attn_meta.block_tables)
        self.block_tables[:b, w:].fill_(scratch)
        self.block_tables[b:bs].fill_(scratch)
        self.seq_lens[:b].copy_(inp.attn_meta.seq_lens)
        self.seq_lens[b:bs].fill_(1)
        self.graphs[bs].replay()
        return self.outputs[bs][:b]
