"""CUDA graphs for decode steps (NORMAL and COMPLETION roles; never PROMPT, SPEC §1).

One graph per batch-size bucket, captured over static input buffers and a block-table
width that covers max_model_len. A step of B attention rows runs the smallest bucket >= B:
padded rows write their K/V into the cache's scratch block and their outputs are dropped.

An engine that drafts `nextn` tokens verifies `1 + nextn` tokens per sequence, fed as one
attention row per token (`input_batch.token_row_attention`): its buckets reach
`max_num_seqs * (1 + nextn)` rows, and the draft (MTP) layer has graphs of its own
(`DraftGraphs`, over the draft's KV layer and the target hidden states it reads).

An expert-parallel rank (the padded dispatch: static shapes, counts on the device) captures its
MoE all-to-alls inside the graphs. Every rank of the instance captures the same batch sizes
(`shared_buckets`), since each capture's warm-up forward enters the collectives; an idle rank
replays the smallest graph over padding rows alone (`run_idle`). Padding rows are routed and
dispatched like real ones but not counted as expert load (`ExpertParallel.num_real`).
"""

from __future__ import annotations

import gc
import logging
from typing import TYPE_CHECKING

import torch

from deepinfer_core.distributed.expert_parallel import NO_ROW_LIMIT
from deepinfer_core.models.layers.attention import AttentionMetadata

if TYPE_CHECKING:
    from deepinfer_core.distributed.group import InstanceGroup
    from deepinfer_core.worker.input_batch import ModelInput
    from deepinfer_core.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def batch_buckets(max_num_seqs: int, tokens_per_seq: int = 1) -> list[int]:
    """Row counts captured: up to 256 sequences' worth of `tokens_per_seq` rows each."""
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(288, 256 * tokens_per_seq + 1, 32))
    top = min(max_num_seqs * tokens_per_seq, 256 * tokens_per_seq)
    return [s for s in sizes if s < top] + [top]


def shared_buckets(buckets: list[int], group: InstanceGroup) -> list[int]:
    """The batch sizes every rank of the instance captures: those all ranks propose (one gather
    over the control group; call on every rank). A rank left with fewer runs its larger batches
    eagerly, whose collectives have the graphs' shapes (the padded dispatch)."""
    proposed = group.gather(list(buckets))
    common = sorted(set.intersection(*(set(p) for p in proposed)))
    if common != sorted(buckets):
        logger.warning("rank %d/%d: capturing the batch sizes every rank proposes, %s (this rank proposed %s)",
                       group.rank, group.size, common, buckets)  # fmt: skip
    return common


class DecodeGraphs:
    def __init__(self, runner: ModelRunner):
        self.runner = runner
        cache = runner.cache
        self.block_size = runner.block_size
        self.width = (runner.config.scheduler.max_model_len + self.block_size - 1) // self.block_size
        sched = runner.config.scheduler
        self.buckets = batch_buckets(sched.max_num_seqs, sched.num_decode_tokens_per_seq)
        if runner.ep is not None:
            self.buckets = shared_buckets(self.buckets, runner.ep.group)
        n, dev = self.buckets[-1], runner.device
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n,), cache.scratch_block * self.block_size, dtype=torch.int64, device=dev)
        self.block_tables = torch.full((n, self.width), cache.scratch_block, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    @classmethod
    def capture(cls, runner: ModelRunner, *args) -> DecodeGraphs:
        self = cls(runner, *args)
        pool = torch.cuda.graph_pool_handle()
        # Nothing but the forward may touch CUDA while a graph is captured. A garbage collection
        # in the middle would free pinned host buffers of earlier steps, and the pinned allocator
        # then queries their events: an illegal call that invalidates the capture. So collect
        # first and keep the collector off; "thread_local" lets other threads (a NIXL progress
        # thread) make their own CUDA calls meanwhile.
        gc.collect()
        gc_was_on = gc.isenabled()
        gc.disable()
        ep = runner.ep
        if ep is not None:  # warm-ups' rows are not expert load; a replay sets its real row count
            ep.num_real.fill_(0)
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
            if ep is not None:
                ep.num_real.fill_(NO_ROW_LIMIT)
        torch.cuda.synchronize()
        logger.info("captured %s for batch sizes %s", type(self).__name__, self.buckets)
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
        return self._replay(inp.input_ids, inp.positions, inp.attn_meta)

    def _replay(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The output is a view of the graph's static buffer: valid until its next replay."""
        b = input_ids.shape[0]
        bs = next(s for s in self.buckets if s >= b)
        scratch = self.runner.cache.scratch_block
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(positions)
        self.slot_mapping[:b].copy_(meta.slot_mapping)
        w = meta.block_tables.shape[1]
        self.block_tables[:b, :w].copy_(meta.block_tables)
        self.block_tables[:b, w:].fill_(scratch)
        self.seq_lens[:b].copy_(meta.seq_lens)
        self._launch(b, bs)
        return self.outputs[bs][:b]

    def run_idle(self) -> None:
        """A step without a real token (an idle expert-parallel rank): the smallest graph over
        padding rows alone, entering the collectives the ranks with work enter."""
        self._launch(0, self.buckets[0])

    def _launch(self, b: int, bs: int) -> None:
        """Replay graph `bs` with rows [b, bs) as padding (their K/V to the scratch block)."""
        scratch = self.runner.cache.scratch_block
        self.slot_mapping[b:bs].fill_(scratch * self.block_size)
        self.block_tables[b:bs].fill_(scratch)
        self.seq_lens[b:bs].fill_(1)
        ep = self.runner.ep
        if ep is not None:
            ep.num_real.fill_(b)
        self.graphs[bs].replay()
        if ep is not None:
            ep.num_real.fill_(NO_ROW_LIMIT)


class DraftGraphs(DecodeGraphs):
    """The MTP layer's decode-shaped passes (one row per position) over its own KV layer. A pool of
    its own: replaying it leaves the target graphs' outputs (the hidden states it reads) intact."""

    def __init__(self, runner: ModelRunner, draft):
        super().__init__(runner)
        self.draft = draft
        n = self.buckets[-1]
        self.prev_hidden = torch.zeros(n, draft.args.hidden_size, dtype=runner.config.model.dtype, device=runner.device)

    @torch.inference_mode()
    def _forward(self, bs: int) -> torch.Tensor:
        kv = self.runner.cache.draft_kv_caches[0]
        return self.draft(self.input_ids[:bs], self.positions[:bs], self.prev_hidden[:bs], kv, self._meta(bs))

    def can_run_rows(self, rows: int, meta: AttentionMetadata) -> bool:
        return meta.is_decode_only and rows <= self.buckets[-1] and meta.block_tables.shape[1] <= self.width

    def run_draft(self, input_ids, positions, prev_hidden, meta: AttentionMetadata) -> torch.Tensor:
        self.prev_hidden[: input_ids.shape[0]].copy_(prev_hidden)
        return self._replay(input_ids, positions, meta)
