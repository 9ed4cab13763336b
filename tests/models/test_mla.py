"""Multi-head latent attention: the compressed cache and the absorbed decode path.

- The paged cache holds one latent vector (kv_lora_rank + qk_rope_head_dim values) per token and
  layer, and nothing else; its bytes per token follow from the config.
- Decode with kv_b_proj absorbed into query and output equals the naive path that expands the
  latents into per-head keys and values (fp32, atol 1e-5), for prefill too; the fixed-shape
  decode used under CUDA graphs equals the dynamic one.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_core import LLM
from deepinfer_core.builtin import TINY_MODEL_DIR
from deepinfer_core.models.layers.attention import AttentionMetadata
from deepinfer_core.models.layers.mla import MLAAttention, deinterleave, set_mla_path
from deepinfer_core.models.loader import load_model
from deepinfer_core.worker.cache_engine import CacheEngine
from deepinfer_kernels.mla_attention import mla_attention_absorbed, mla_attention_naive, write_latent_cache
from deepinfer_kernels.mla_decode import mla_decode_attention_ref
from tests.helpers.hf_models import TINY_MLA, model_config_for, save_hf_checkpoint
from tests.helpers.numerics import random_prompt
from tests.helpers.paged import PagedRunner, build_attention_metadata

LATENT = TINY_MLA["kv_lora_rank"] + TINY_MLA["qk_rope_head_dim"]  # 24 values per token and layer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("deepseek_v3")
    save_hf_checkpoint("deepseek_v3", directory, seed=11)
    return directory


@pytest.fixture(scope="module")
def model(checkpoint):
    return load_model(model_config_for(checkpoint), "cpu")


@pytest.mark.parametrize("dtype,elem", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_paged_cache_holds_only_the_latent(checkpoint, dtype, elem) -> None:
    name = str(dtype).split(".")[-1]
    llm = LLM(str(checkpoint), tokenizer=TINY_MODEL_DIR, dtype=name, max_model_len=64, num_gpu_blocks=8, block_size=4)
    cache = llm.engine.cache
    layers = TINY_MLA["num_hidden_layers"]
    assert cache.kv_buffer.shape == (layers, 8 + 1, 4, LATENT)  # +1: the scratch block
    per_token = CacheEngine.bytes_per_block(layers, cache.block_shape, dtype) // 4
    assert per_token == layers * LATENT * elem
    heads, qk = TINY_MLA["num_attention_heads"], TINY_MLA["qk_nope_head_dim"] + TINY_MLA["qk_rope_head_dim"]
    assert per_token * 6 < layers * heads * (qk + TINY_MLA["v_head_dim"]) * elem  # vs an uncompressed cache


@torch.inference_mode()
def test_cache_rows_are_normalised_latent_and_rotated_rope_key(model) -> None:
    runner = PagedRunner(model, block_size=4)
    prompt = random_prompt(6, seed=1)
    runner.step([("s", prompt)])
    attn: MLAAttention = model.model.layers[0].self_attn
    x = model.model.layers[0].input_layernorm(model.model.embed_tokens(torch.tensor(prompt)))
    c, k_pe = attn.kv_a_proj_with_mqa(x).split([TINY_MLA["kv_lora_rank"], TINY_MLA["qk_rope_head_dim"]], dim=-1)
    k_pe = deinterleave(k_pe)  # DeepSeek's adjacent rotary pairs, stored in rotate-half order
    table = runner.cache.block_tables["s"]
    rows = torch.stack([runner.cache.kv_caches[0][table[p // 4], p % 4] for p in range(6)])  # [6, L + R]
    torch.testing.assert_close(rows[:, : TINY_MLA["kv_lora_rank"]], attn.kv_a_layernorm(c), atol=1e-6, rtol=0)
    assert rows[0, TINY_MLA["kv_lora_rank"] :].sub(k_pe[0]).abs().max() < 1e-6  # position 0: no rotation
    assert rows[3, TINY_MLA["kv_lora_rank"] :].sub(k_pe[3]).abs().max() > 1e-3  # later positions rotate


def _decode_logits(model, path: str) -> list[torch.Tensor]:
    set_mla_path(model, path)
    try:
        runner = PagedRunner(model, block_size=4)
        batch = [("a", random_prompt(7, seed=2)), ("b", random_prompt(3, seed=3))]
        logits = [torch.cat(runner.step(batch))]
        for step in range(5):
            logits.append(torch.cat(runner.step([("a", [10 + step]), ("b", [20 + step])])))
        return logits
    finally:
        set_mla_path(model, "auto")


def test_absorbed_decode_equals_naive_path(model) -> None:
    naive = _decode_logits(model, "naive")
    auto = _decode_logits(model, "auto")  # prefill naive, decode absorbed
    absorbed = _decode_logits(model, "absorbed")  # absorbed everywhere, prefill included
    for n, a, b in zip(naive, auto, absorbed):
        torch.testing.assert_close(a, n, atol=1e-5, rtol=0)
        torch.testing.assert_close(b, n, atol=1e-5, rtol=0)


def test_fixed_shape_decode_equals_dynamic_decode(model) -> None:
    """The CUDA-graph decode path (static block-table width, no host sync, padded rows writing to a
    scratch block) gives the dynamic path's hidden states."""
    runner = PagedRunner(model, block_size=4, num_blocks=32)
    runner.step([("a", random_prompt(9, seed=4)), ("b", random_prompt(2, seed=5))])
    snapshot = [c.clone() for c in runner.cache.kv_caches]
    tables = [runner.cache.reserve(k, runner.lengths[k] + 1) for k in ("a", "b")]
    meta, positions = build_attention_metadata([(9, 1), (2, 1)], tables, 4)
    tokens = torch.tensor([3, 4])
    with torch.inference_mode():
        want = model(tokens, positions, runner.cache.kv_caches, meta)
        width, scratch = 6, runner.cache.free_blocks[0]  # padded rows write into an unused block
        static = AttentionMetadata(
            slot_mapping=torch.cat([meta.slot_mapping, torch.tensor([scratch * 4])]),
            block_tables=torch.tensor([t + [scratch] * (width - len(t)) for t in tables] + [[scratch] * width]),
            query_start_loc=torch.arange(4, dtype=torch.int32),
            seq_lens=torch.tensor([10, 3, 1], dtype=torch.int32),
            query_lens_cpu=[1, 1, 1],
            seq_lens_cpu=[],
            is_decode_only=True,
            static_shapes=True,
        )
        got = model(torch.tensor([3, 4, 0]), torch.cat([positions, torch.tensor([0])]), snapshot, static)
    torch.testing.assert_close(got[:2], want, atol=1e-5, rtol=0)


def test_kernel_paths_agree_on_random_inputs() -> None:
    g = torch.Generator().manual_seed(0)
    heads, dn, dv, rank, rope, bs = 3, 8, 6, 10, 4, 4
    cache = torch.zeros(12, bs, rank + rope)
    tables = torch.tensor([[5, 2, 9, 0], [7, 1, 0, 0]], dtype=torch.int32)
    lens = [13, 6]
    slots = torch.tensor([int(tables[b, p // bs]) * bs + p % bs for b in range(2) for p in range(lens[b])])
    write_latent_cache(torch.randn(19, rank + rope, generator=g), cache, slots)
    write_latent_cache(torch.full((1, rank + rope), 99.0), cache, torch.tensor([-1]))  # padding: not written
    assert not bool((cache == 99.0).any())
    w = torch.randn(heads, dn + dv, rank, generator=g)
    q_nope, q_pe = torch.randn(2, heads, dn, generator=g), torch.randn(2, heads, rope, generator=g)
    naive = mla_attention_naive(q_nope, q_pe, cache, w, tables, [1, 1], lens, 0.3)  # [2, H, Dv]
    q_lat = torch.einsum("thd,hdl->thl", q_nope, w[:, :dn])
    lat = mla_attention_absorbed(q_lat, q_pe, cache, tables, [1, 1], lens, 0.3)  # [2, H, L]
    torch.testing.assert_close(torch.einsum("thl,hvl->thv", lat, w[:, dn:]), naive, atol=1e-5, rtol=0)
    static = mla_decode_attention_ref(q_lat, q_pe, cache, tables, torch.tensor(lens), 0.3)  # fixed-width decode
    torch.testing.assert_close(static, lat, atol=1e-6, rtol=0)
