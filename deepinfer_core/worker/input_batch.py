"""Turn a scheduled step into model inputs: flat tokens, positions, attention metadata.

Sequence i of the step feeds tokens [num_cached_tokens, num_cached_tokens + n_i):
fresh prompts, chunks, prompts after prefix hits and decode tokens are all the same case.
Host lists reach the device through non-blocking copies (`to_device`), so building a
step's inputs never waits for the step still running on the device. A token that is still
a placeholder (zero-overhead scheduling: sampled by the running step) goes in as is; the
runner overwrites it on the device before the forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from deepinfer_core.models.layers.attention import AttentionMetadata
from deepinfer_core.multimodal.inputs import image_rows
from deepinfer_core.sequence import Sequence
from deepinfer_core.worker.events import to_device


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn_meta: AttentionMetadata
    sample_indices: list[int]  # row of the hidden states each sampling sequence samples from
    prompt_logprob_spans: list[tuple[int, int, int, int]]
    """(batch index, first row, number of rows, first position) for prompt-logprob rows."""
    mm_rows: Optional[torch.Tensor] = None  # [P] int64: rows fed image embeddings instead of tokens
    mm_embeds: Optional[torch.Tensor] = None  # [P, H]: the embeddings of those rows


def build_model_input(
    seqs: list[Sequence],
    num_new_tokens: list[int],
    block_size: int,
    device: torch.device,
    want_prompt_logprobs: bool = True,
    token_rows: bool = False,
) -> ModelInput:
    """`token_rows`: every new token is its own attention row (`token_row_attention`), so a step of
    a few tokens per sequence (speculative verification) runs the decode kernels and graphs."""
    tokens: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    sample_indices: list[int] = []
    spans: list[tuple[int, int, int, int]] = []
    seq_lens, query_lens = [], []
    mm_rows: list[int] = []
    mm_embeds: list[torch.Tensor] = []
    for i, (seq, n) in enumerate(zip(seqs, num_new_tokens)):
        start, end = seq.num_cached_tokens, seq.num_cached_tokens + n
        row0 = len(tokens)
        tokens += seq.token_slice(start, end)
        positions += range(start, end)
        for pos, embeds in image_rows(seq.mm_placeholders, start, end):
            mm_rows += range(row0 + pos - start, row0 + pos - start + embeds.shape[0])
            mm_embeds.append(embeds)
        table = seq.block_table
        slots += [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
        query_lens.append(n)
        seq_lens.append(end)
        if end == len(seq):
            sample_indices.append(row0 + n - 1)
        if want_prompt_logprobs and seq.params.prompt_logprobs is not None:
            last = min(end, seq.num_prompt_tokens - 1)  # position p scores token p + 1
            if last > start:
                spans.append((i, row0, last - start, start))
    if token_rows and seqs:
        meta = token_row_attention(seqs, [e - q for e, q in zip(seq_lens, query_lens)], query_lens, slots, device)
    else:
        meta = _sequence_attention(seqs, slots, query_lens, seq_lens, device)
    return ModelInput(
        input_ids=to_device(tokens, torch.int64, device),
        positions=to_device(positions, torch.int64, device),
        attn_meta=meta,
        sample_indices=sample_indices,
        prompt_logprob_spans=spans,
        mm_rows=to_device(mm_rows, torch.int64, device) if mm_rows else None,
        mm_embeds=torch.cat(mm_embeds).to(device) if mm_embeds else None,
    )


def _block_table_rows(seqs: list[Sequence], repeats: list[int]) -> list[list[int]]:
    width = max(max((len(s.block_table) for s in seqs), default=1), 1)
    return [s.block_table + [0] * (width - len(s.block_table)) for s, r in zip(seqs, repeats) for _ in range(r)]


def _sequence_attention(seqs, slots, query_lens, seq_lens, device) -> AttentionMetadata:
    """One attention row per sequence, its new tokens causal over its context."""
    table = _block_table_rows(seqs, [1] * len(seqs)) if seqs else torch.zeros((0, 1), dtype=torch.int32)
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    return AttentionMetadata(
        slot_mapping=to_device(slots, torch.int64, device),
        block_tables=to_device(table, torch.int32, device),  # one tensor build, not one per row
        query_start_loc=to_device(qsl, torch.int32, device),
        seq_lens=to_device(seq_lens, torch.int32, device),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        is_decode_only=all(q == 1 for q in query_lens),
    )


def token_row_attention(
    seqs: list[Sequence], starts: list[int], counts: list[int], slots: list[int], device: torch.device
) -> AttentionMetadata:
    """One attention row per new token: the token at position p of sequence s reads s's blocks up to
    p (its row's length is p + 1). Every new token's KV is written before attention, so this is the
    causal attention of the sequence's new tokens, in the one-token-per-row shape of decode: the
    decode kernels (and captured decode graphs) run it instead of the per-sequence prefill path."""
    lens = [p + 1 for s, n in zip(starts, counts) for p in range(s, s + n)]
    return AttentionMetadata(
        slot_mapping=to_device(slots, torch.int64, device),
        block_tables=to_device(_block_table_rows(seqs, counts), torch.int32, device),
        query_start_loc=to_device(list(range(len(lens) + 1)), torch.int32, device),
        seq_lens=to_device(lens, torch.int32, device),
        query_lens_cpu=[1] * len(lens),
        seq_lens_cpu=lens,
        is_decode_only=True,
    )


def placeholder_input(device: torch.device) -> ModelInput:
    """One dummy token that writes no KV: the fixed-beat forward of an empty PROMPT step."""
    meta = AttentionMetadata(
        slot_mapping=torch.full((1,), -1, dtype=torch.int64, device=device),
        block_tables=torch.zeros((1, 1), dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=device),
        seq_lens=torch.ones(1, dtype=torch.int32, device=device),
        query_lens_cpu=[1],
        seq_lens_cpu=[1],
        is_decode_only=True,
    )
    zeros = torch.zeros(1, dtype=torch.int64, device=device)
    return ModelInput(zeros, zeros.clone(), meta, [], [])
