"""The engine on a GPU (skipped without one): CUDA graphs on and off agree with each other
and with transformers; graphs are really replayed for decode; zero-overhead scheduling on and
off agree; PROMPT engines capture none."""

import shutil

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.builtin import TINY_MODEL_DIR
from deepinfer_core.roles import EngineType
from tests.helpers.hf_models import save_hf_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    hf = save_hf_checkpoint("qwen3", path, seed=3)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{TINY_MODEL_DIR}/{name}", path / name)
    hf.generation_config.eos_token_id = None
    return str(path), hf


def _prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 250, (n,), generator=g).tolist() for n in (3, 17, 40, 9, 64, 100)]


def _hf(hf, prompt, n):
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def test_fp32_graphs_and_eager_equal_transformers(checkpoint):
    path, hf = checkpoint
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = [_hf(hf, p, 12) for p in _prompts()]
    results = {}
    for eager in (True, False):
        llm = LLM(
            path,
            device="cuda",
            dtype="float32",
            max_model_len=256,
            enforce_eager=eager,
            max_num_seqs=32,
            num_gpu_blocks=512,
        )
        runner = llm.engine.worker.runner
        assert (runner.graphs is None) == eager
        replays = 0
        if runner.graphs is not None:
            orig = runner.graphs.run

            def counted(inp, orig=orig):
                nonlocal replays
                replays += 1
                return orig(inp)

            runner.graphs.run = counted
        outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params)
        results[eager] = [o.outputs[0].token_ids for o in outs]
        if not eager:
            assert replays >= 11  # every decode step of the batch ran a captured graph
    assert results[True] == want
    assert results[False] == want


def test_zero_overhead_scheduling_equals_synchronous_steps_with_graphs(checkpoint):
    """The overlapped step (next step launched before this one is read back, placeholder tokens
    filled on the device, captured decode graphs) gives what the synchronous step gives."""
    path, _ = checkpoint
    llm = LLM(path, device="cuda", dtype="float32", max_model_len=256, max_num_seqs=32, num_gpu_blocks=512)
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=5, max_tokens=10, ignore_eos=True),
        SamplingParams(n=2, temperature=0.8, seed=6, max_tokens=7, ignore_eos=True),
    ] * 2
    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    results = {}
    for zos in (False, True):
        llm.engine.zero_overhead_scheduling = zos
        llm.engine.scheduler.block_manager.reset_prefix_cache()
        outs = llm.generate(prompts, params)
        results[zos] = [[c.token_ids for c in o.outputs] for o in outs]
    assert results[True] == results[False]
    assert llm.engine.scheduler.block_manager.num_free_blocks == 512


def test_bf16_on_gpu_stays_close_to_transformers(checkpoint):
    path, hf = checkpoint
    prompt = _prompts()[4]
    llm = LLM(path, device="cuda", dtype="bfloat16", max_model_len=256, num_gpu_blocks=512)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    got = [out[0].prompt_logprobs[i][prompt[i]] for i in range(1, len(prompt))]
    with torch.inference_mode():
        logits = hf.to("cuda", torch.bfloat16)(torch.tensor([prompt], device="cuda")).logits[0].float()
    hf.to("cpu", torch.float32)
    lp = torch.log_softmax(logits, -1)
    want = [lp[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
    assert max(abs(a - b) for a, b in zip(got, want)) < 0.1


@pytest.mark.parametrize("block_size", [None, 16])
def test_mla_model_on_gpu_takes_64_token_blocks_and_equals_transformers(tmp_path, block_size):
    """DeepSeek-V3 (a latent cache) on CUDA defaults to 64-token KV blocks (engine_args.default_block_size).
    In fp32, at that size and at 16: prompt log-probs over 100 tokens (two blocks of 64 and part of a
    third) match transformers, and so do 12 greedy tokens decoded across the block boundary."""
    hf = save_hf_checkpoint("deepseek_v3", tmp_path, seed=3)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{TINY_MODEL_DIR}/{name}", tmp_path / name)
    hf.generation_config.eos_token_id = None
    prompt = _prompts()[5]
    llm = LLM(
        str(tmp_path), device="cuda", dtype="float32", max_model_len=256, num_gpu_blocks=64, block_size=block_size
    )
    assert llm.engine.scheduler.block_manager.block_size == (block_size or 64)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=0)
    out = llm.generate([{"prompt_token_ids": prompt}], params)[0]
    got = [out.prompt_logprobs[i][prompt[i]] for i in range(1, len(prompt))]
    with torch.inference_mode():
        lp = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    want = [lp[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-3
    assert out.outputs[0].token_ids == _hf(hf, prompt, 12)


def test_prompt_engine_captures_no_graphs(checkpoint):
    path, _ = checkpoint
    llm = LLM(
        path, device="cuda", dtype="float32", max_model_len=256, engine_type=EngineType.PROMPT, num_gpu_blocks=512
    )
    assert llm.engine.worker.runner.graphs is None and not llm.engine.worker.runner.use_cuda_graph


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "deepseek_v3"])
def test_overlapped_decode_step_waits_for_the_device_only_at_the_read_back(tmp_path, family):
    """With zero-overhead scheduling a decode step's host work must not wait for the device: the
    only wait of a steady-state step is for the previous step's samples (an event right behind
    them). Any other (a pageable copy, an `.item()`, a `.tolist()` of a device tensor, which waits
    for the step launched after it too) makes the GPU idle while the host works; the failure lists
    where each wait came from."""
    import traceback
    import warnings

    save_hf_checkpoint(family, tmp_path, seed=3)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{TINY_MODEL_DIR}/{name}", tmp_path / name)
    llm = LLM(str(tmp_path), device="cuda", dtype="bfloat16", max_model_len=256, max_num_seqs=32, num_gpu_blocks=512)
    engine = llm.engine
    engine.zero_overhead_scheduling = True
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, detokenize=False)
    for i, p in enumerate(_prompts()):
        engine.add_request(f"r{i}", prompt_token_ids=p, params=params)
    for _ in range(6):  # prefill, then steady decode (graphs captured, allocator caches warm)
        engine.step()
    waits: list[str] = []

    def record(message, category, filename, lineno, file=None, line=None):
        waits.append(f"{message}\n" + "".join(traceback.format_stack(limit=12)[:-1]))

    steps = 5
    probe = torch.ones(1, device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                engine.step()
            probe.item()  # one deliberate wait: the check is live
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # HostCopy.wait waits for one event behind the read step's own kernels; a `.tolist()` on a
    # device tensor would wait for everything queued, the next step included, and is reported
    other = [w for w in waits if not ("events.py" in w and "in wait" in w) and "is a prototype feature" not in w]
    assert other and "probe.item()" in other[-1], "the sync debug mode reported nothing: the check is not live"
    other = other[:-1]
    assert not other, f"{len(other)} unexpected device waits in {steps} steps; first:\n" + "\n".join(other[:3])
    while engine.has_unfinished_requests():
        engine.step()
