"""On a GPU: the kernels against their references at GPU sizes (bf16), and the engine's
numerics with the Triton kernels on: model logits through the paged cache against HF
transformers (fp32), and greedy generation on CUDA (decode CUDA graphs, Triton attention)
token for token equal to transformers. Skipped where no GPU exists (CI)."""

from __future__ import annotations

import shutil

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from benchmarks.kernel_bench.checks import run_checks  # noqa: E402
from deepinfer_core import LLM, SamplingParams  # noqa: E402
from deepinfer_core.builtin import TINY_MODEL_DIR  # noqa: E402
from deepinfer_core.models.loader import load_model  # noqa: E402
from deepinfer_kernels import registry  # noqa: E402
from tests.helpers.hf_models import (  # noqa: E402
    hf_logits,
    model_config_for,
    quantize_checkpoint_fp8,
    save_hf_checkpoint,
)
from tests.helpers.paged import PagedRunner  # noqa: E402

ATOL = 1e-4  # fp32 logits; the kernels' fp32 dots run in full fp32


def test_every_kernel_matches_its_reference_on_gpu() -> None:
    results = run_checks(torch.device("cuda"), seed=7, small=False)
    failed = [r for r in results if not r.ok]
    assert results and not failed, failed


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = save_hf_checkpoint(request.param, path, seed=5, rope_scaling=None)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{TINY_MODEL_DIR}/{name}", path / name)
    hf.generation_config.eos_token_id = None
    return hf, path


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_paged_logits_with_kernels_match_hf(checkpoint) -> None:
    hf, path = checkpoint
    assert registry.use_triton(torch.zeros(1, device="cuda"))
    model = load_model(model_config_for(path), "cuda")
    runner = PagedRunner(model, block_size=4, num_blocks=128)
    cached, fresh = _prompt(21, 1), _prompt(13, 2)
    runner.step([("c", cached[:9])])  # a cached prefix for the next, mixed step
    out_rest, out_fresh = runner.step([("c", cached[9:]), ("f", fresh)])
    torch.testing.assert_close(out_rest.cpu(), hf_logits(hf, cached)[9:], atol=ATOL, rtol=0)
    torch.testing.assert_close(out_fresh.cpu(), hf_logits(hf, fresh), atol=ATOL, rtol=0)
    seqs = {"c": cached, "f": fresh}
    last = {"c": out_rest[-1], "f": out_fresh[-1]}
    for _ in range(4):  # decode-only steps: the split-KV decode kernel
        batch = [(s, [int(last[s].argmax())]) for s in seqs]
        for (s, tok), logits in zip(batch, runner.step(batch), strict=True):
            seqs[s] = seqs[s] + tok
            last[s] = logits[0]
            torch.testing.assert_close(logits[0].cpu(), hf_logits(hf, seqs[s])[-1], atol=ATOL, rtol=0)


def test_greedy_generation_on_cuda_with_graphs_matches_hf(checkpoint) -> None:
    hf, path = checkpoint
    prompts = [_prompt(n, 10 + n) for n in (3, 17, 40, 9)]
    llm = LLM(str(path), device="cuda:0", dtype="float32", max_model_len=256, num_gpu_blocks=128, block_size=16)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for p, o in zip(prompts, outs, strict=True):
        with torch.inference_mode():
            want = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, pad_token_id=0)
        assert o.outputs[0].token_ids == want[0, len(p) :].tolist()


def _kernels_vs_torch_error(model, prompts: dict[str, list[int]], num_blocks: int) -> float:
    """Relative difference of three decode steps' logits (after prefilling `prompts`) between the
    Triton kernels and the pure-torch ops, on the same model and paged cache layout."""
    logits = {}
    for backend in ("triton", "torch"):
        registry.set_backend(backend)
        try:
            runner = PagedRunner(model, block_size=16, num_blocks=num_blocks)
            runner.step(list(prompts.items()))
            steps = [runner.step([(s, [7 + i]) for i, s in enumerate(prompts)]) for _ in range(3)]
            logits[backend] = torch.stack([torch.cat(step) for step in steps]).float()
        finally:
            registry.set_backend("auto")
    return ((logits["triton"] - logits["torch"]).norm() / logits["torch"].norm()).item()


@pytest.mark.skipif(torch.cuda.get_device_capability() != (9, 0), reason="the warp-group MLA kernels are sm_90's")
@pytest.mark.parametrize("heads", [128, 16], ids=["heads as rows", "tokens as rows"])
def test_deepseek_decode_through_the_sm90_mla_kernel_matches_the_torch_path(tmp_path, heads) -> None:
    """DeepSeek-V3 attention at its latent dims (512 + 64) in bf16, with all 128 heads and with a
    tensor-parallel rank's 16: decode logits through the engine's paged cache with the Triton kernels
    (one of the sm_90 warp-group MLA kernels among them) against the same model on the pure-torch ops."""
    save_hf_checkpoint("deepseek_v3", tmp_path, seed=3, num_attention_heads=heads, num_key_value_heads=heads,
                       kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
                       rope_scaling=None)  # fmt: skip
    model = load_model(model_config_for(tmp_path, dtype=torch.bfloat16), "cuda")
    prompts = {"a": _prompt(70, 3), "b": _prompt(150, 4), "c": _prompt(5, 5)}
    assert _kernels_vs_torch_error(model, prompts, num_blocks=64) < 2e-2


def test_fp8_deepseek_through_the_kernels_matches_the_torch_path(tmp_path) -> None:
    """A block-FP8 DeepSeek-V3 checkpoint in bf16 on CUDA: decode logits with the Triton kernels
    (the fused MoE reading the FP8 experts as stored) against the pure-torch ops (dequantized experts)."""
    save_hf_checkpoint("deepseek_v3", tmp_path / "fp8", seed=5, moe_intermediate_size=256, hidden_size=256)
    (tmp_path / "ref").mkdir()
    quantize_checkpoint_fp8(tmp_path / "fp8", tmp_path / "ref", (128, 128))
    model = load_model(model_config_for(tmp_path / "fp8", dtype=torch.bfloat16), "cuda")
    assert _kernels_vs_torch_error(model, {"a": _prompt(40, 6), "b": _prompt(9, 7)}, num_blocks=32) < 2e-2


@pytest.mark.skipif(torch.cuda.get_device_capability() != (9, 0), reason="the warp-group MLA kernels are sm_90's")
@pytest.mark.parametrize("heads", [128, 16], ids=["heads as rows", "tokens as rows"])
def test_deepseek_generation_with_decode_graphs_equals_eager(tmp_path, heads) -> None:
    """The sm_90 MLA kernels inside the engine's decode CUDA graphs: greedy tokens of a DeepSeek-V3
    with 128 (or a tensor-parallel rank's 16) heads in bf16 equal those of the same engine run eagerly
    (same kernels, no graphs)."""
    save_hf_checkpoint("deepseek_v3", tmp_path, seed=4, num_attention_heads=heads, num_key_value_heads=heads,
                       kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
                       rope_scaling=None)  # fmt: skip
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{TINY_MODEL_DIR}/{name}", tmp_path / name)
    prompts = [{"prompt_token_ids": _prompt(n, 20 + n)} for n in (5, 33, 70)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    tokens = []
    for eager in (False, True):
        llm = LLM(str(tmp_path), device="cuda:0", dtype="bfloat16", max_model_len=256, num_gpu_blocks=64,
                  block_size=16, enforce_eager=eager)  # fmt: skip
        tokens.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        del llm
        torch.cuda.empty_cache()
    assert tokens[0] == tokens[1]
