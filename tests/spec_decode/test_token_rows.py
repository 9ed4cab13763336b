"""Verification steps feed one attention row per token (`input_batch.token_row_attention`), the shape
of decode, so the decode kernels and the captured decode graphs run them. That layout must attend
exactly as the per-sequence (prefill-shaped) one: each new token sees its sequence's context and the
new tokens before it."""

from __future__ import annotations

import math

import torch

from deepinfer_core.models.layers.mla import MLAArgs, MLAAttention
from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.sequence import Sequence
from deepinfer_core.worker.cuda_graph import batch_buckets
from deepinfer_core.worker.input_batch import build_model_input

BLOCK = 4
ARGS = MLAArgs(
    hidden_size=48, num_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
    v_head_dim=8, rms_norm_eps=1e-6, attention_bias=False, rope_interleave=False, scale=16**-0.5,
)  # fmt: skip


def _rope(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = 1.0 / 10000 ** (torch.arange(0, ARGS.qk_rope_head_dim, 2).float() / ARGS.qk_rope_head_dim)
    angles = positions.float()[:, None] * freqs[None]
    return angles.cos(), angles.sin()


def _sequences(context: list[int], new: list[int]) -> list[Sequence]:
    seqs, first = [], 0
    for i, (c, n) in enumerate(zip(context, new)):
        seq = Sequence(i, f"s{i}", list(range(c + n)), SamplingParams(max_tokens=1))
        blocks = math.ceil((c + n) / BLOCK)
        seq.block_table = list(range(first, first + blocks))
        seq.num_cached_tokens = c
        first += blocks
        seqs.append(seq)
    return seqs


def test_token_rows_attend_as_the_sequence_layout():
    torch.manual_seed(0)
    layer = MLAAttention(ARGS, torch.float32)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    context, new = [5, 9, 1], [3, 1, 2]  # a verification step: 1 + drafts tokens per sequence
    seqs = _sequences(context, new)
    cache = torch.zeros(sum(len(s.block_table) for s in seqs) + 1, BLOCK, ARGS.kv_lora_rank + ARGS.qk_rope_head_dim)
    for s, c in zip(seqs, context):  # the context's latents, as earlier steps wrote them
        s.num_cached_tokens = 0
        prefill = build_model_input([s], [c], BLOCK, torch.device("cpu"))
        layer(torch.randn(c, ARGS.hidden_size), _rope(prefill.positions), cache, prefill.attn_meta)
        s.num_cached_tokens = c
    x = torch.randn(sum(new), ARGS.hidden_size)
    outs = {}
    for token_rows in (False, True):
        inp = build_model_input(seqs, new, BLOCK, torch.device("cpu"), token_rows=token_rows)
        assert inp.attn_meta.is_decode_only == token_rows
        outs[token_rows] = layer(x, _rope(inp.positions), cache.clone(), inp.attn_meta)
    meta = build_model_input(seqs, new, BLOCK, torch.device("cpu"), token_rows=True).attn_meta
    assert meta.seq_lens_cpu == [6, 7, 8, 10, 2, 3] and meta.block_tables.shape[0] == sum(new)
    torch.testing.assert_close(outs[True], outs[False], rtol=1e-4, atol=1e-5)


def test_graph_buckets_cover_the_verification_rows():
    assert batch_buckets(32, 3)[-1] == 96 and batch_buckets(300, 2)[-1] == 512
    assert batch_buckets(512) == batch_buckets(256)  # engines that do not draft: as before
