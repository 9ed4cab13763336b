"""Paged-KV test scaffolding: attention metadata, per-layer caches and a step driver.

Tests feed models the way the model runner does — a flat batch of new tokens from several
sequences, each with some context already in the cache — without the scheduler or runner:

    runner = PagedRunner(model, block_size=4)
    logits = runner.step([("a", prompt_a), ("b", prompt_b)])  # prefill both
    logits = runner.step([("a", [next_a]), ("b", [next_b])])  # one decode step

Blocks are handed out in a shuffled order, so block tables are not the identity and a
model that ignored them would fail.
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Sequence

import torch
from torch import nn

from deepinfer_core.models.layers.attention import AttentionMetadata


def build_attention_metadata(
    seqs: Sequence[tuple[int, int]],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: str | torch.device = "cpu",
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata and positions [T] for one step.

    Args:
        seqs: per sequence, (cached_len, num_new): tokens already in its cache, tokens fed now.
        block_tables: per sequence, its KV block ids, enough for cached_len + num_new tokens.
        block_size: tokens per block.
    """
    positions, slots = [], []
    for (cached, new), table in zip(seqs, block_tables, strict=True):
        if len(table) * block_size < cached + new:
            raise ValueError(f"{len(table)} blocks cannot hold {cached + new} tokens")
        for p in range(cached, cached + new):
            positions.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
    query_lens = [new for _, new in seqs]
    seq_lens = [cached + new for cached, new in seqs]
    width = max(len(t) for t in block_tables)
    tables = [list(t) + [0] * (width - len(t)) for t in block_tables]
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        is_decode_only=all(q == 1 for q in query_lens),
    )
    return meta, torch.tensor(positions, dtype=torch.int64, device=device)


class PagedKVCache:
    """One zeroed cache tensor per model layer plus a toy block allocator keyed by sequence id."""

    def __init__(
        self,
        model: nn.Module,
        block_size: int = 4,
        num_blocks: int = 64,
        dtype: torch.dtype | None = None,
        seed: int = 0,
    ):
        param = next(model.parameters())
        shape = (num_blocks, *model.kv_cache_block_shape(block_size))
        self.block_size = block_size
        self.kv_caches = [
            torch.zeros(shape, dtype=dtype or param.dtype, device=param.device)
            for _ in range(model.num_kv_cache_layers)
        ]
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.block_tables: dict[Hashable, list[int]] = {}

    def reserve(self, seq_id: Hashable, num_tokens: int) -> list[int]:
        """Grow the sequence's block table to hold `num_tokens`; returns the table."""
        table = self.block_tables.setdefault(seq_id, [])
        needed = -(-num_tokens // self.block_size) - len(table)
        if needed > len(self.free_blocks):
            raise RuntimeError(f"out of KV blocks: need {needed}, {len(self.free_blocks)} free")
        table.extend(self.free_blocks.pop() for _ in range(max(needed, 0)))
        return table


class PagedRunner:
    """Feeds token batches through a model and its paged cache, tracking each sequence's length."""

    def __init__(self, model: nn.Module, block_size: int = 4, num_blocks: int = 64):
        self.model = model
        self.cache = PagedKVCache(model, block_size, num_blocks)
        self.lengths: dict[Hashable, int] = {}

    def step(self, batch: Sequence[tuple[Hashable, Sequence[int]]]) -> list[torch.Tensor]:
        """Feed each sequence's new tokens in one flat batch; returns per-sequence logits [n_new, V]."""
        seqs, tables, tokens = [], [], []
        for seq_id, new_tokens in batch:
            cached = self.lengths.get(seq_id, 0)
            tables.append(self.cache.reserve(seq_id, cached + len(new_tokens)))
            seqs.append((cached, len(new_tokens)))
            tokens.extend(new_tokens)
        device = self.cache.kv_caches[0].device
        meta, positions = build_attention_metadata(seqs, tables, self.cache.block_size, device)
        input_ids = torch.tensor(tokens, dtype=torch.int64, device=device)
        with torch.inference_mode():
            hidden = self.model(input_ids, positions, self.cache.kv_caches, meta)  # [T, H]
            logits = self.model.compute_logits(hidden)  # [T, V]
        for (seq_id, new_tokens), (cached, _) in zip(batch, seqs, strict=True):
            self.lengths[seq_id] = cached + len(new_tokens)
        return list(logits.split([n for _, n in seqs]))
