"""Expert parallelism with real processes: EP=2 and EP=4 instances (gloo) give the greedy tokens
of one process holding every expert, and transformers' own, on the built-in DeepSeek-style model
and on random Qwen3-MoE and DeepSeek-V3 checkpoints saved with transformers.

One spawn of four ranks serves every case: EP=4 over all of them, then two EP=2 instances side
by side ({0, 1} and {2, 3}) with unevenly spread prompts, so ranks also idle through dummy steps.
"""

import shutil

import pytest
import torch

from deepinfer_core.builtin import TINY_MODEL_DIR
from deepinfer_core.distributed.group import InstanceGroup
from tests.helpers.engines import greedy, make_engine, run_to_completion
from tests.helpers.ep import RANK_ERROR, run_ranks, serve_prompts
from tests.helpers.hf_models import save_hf_checkpoint

MAX_NEW = 6
CHECKPOINTS = ("qwen3_moe", "deepseek_v3")
# EP=2 instance -> {rank in the instance: prompt indices}; instance B's first rank has one prompt
EP2_SPLITS = ({0: [0, 1], 1: [2, 3]}, {0: [0], 1: [1, 2, 3]})


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab - 6, (n,), generator=g).tolist() for n in (3, 17, 30, 9)]


def _ranks_main(group, models: dict[str, dict], params) -> dict:
    """Every model at EP=4, then at EP=2 in two instances; {model: {"ep4"|"ep2": tokens by prompt}}."""
    pairs = [InstanceGroup.subgroup([0, 1]), InstanceGroup.subgroup([2, 3])]  # every rank creates both
    mine = next(i for i, g in enumerate(pairs) if g.rank >= 0)
    out = {}
    for name, spec in models.items():
        prompts = spec["prompts"]
        ep4 = serve_prompts(group, spec["engine_kw"], {r: [prompts[r]] for r in range(4)}, params)
        split = EP2_SPLITS[mine]
        ep2 = serve_prompts(pairs[mine], spec["engine_kw"], {r: [prompts[i] for i in split[r]] for r in split}, params)
        out[name] = {
            "ep4": {group.rank: ep4["tokens"][f"r{group.rank}-0"]},
            "ep2": {i: ep2["tokens"][f"r{pairs[mine].rank}-{k}"] for k, i in enumerate(split[pairs[mine].rank])},
            "dummy_ep2": ep2["dummy_steps"],
        }
    return out


def _hf_greedy(hf, prompt: list[int]) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                          pad_token_id=0)  # fmt: skip
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> engine kwargs, prompts, references (EP=1 engine; transformers for checkpoints)."""
    specs = {"tiny": {"engine_kw": {}, "prompts": _prompts(1024), "hf": None}}
    for family in CHECKPOINTS:
        path = tmp_path_factory.mktemp(family)
        hf = save_hf_checkpoint(family, path, seed=3, rope_scaling=None)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(f"{TINY_MODEL_DIR}/{name}", path / name)
        specs[family] = {"engine_kw": {"model": str(path)}, "prompts": _prompts(256), "hf": hf}
    for spec in specs.values():
        engine = make_engine(dtype="float32", num_gpu_blocks=128, **spec["engine_kw"])
        for i, p in enumerate(spec["prompts"]):
            engine.add_request(str(i), params=greedy(MAX_NEW), prompt_token_ids=p)
        done = run_to_completion(engine)
        spec["ep1"] = [list(done[str(i)].outputs[0].token_ids) for i in range(len(spec["prompts"]))]
        spec["transformers"] = [_hf_greedy(spec["hf"], p) for p in spec["prompts"]] if spec["hf"] else None
    return specs


@pytest.fixture(scope="module")
def served(models):
    """What the four ranks generated, per model: {model: {"ep4"|"ep2": [tokens per prompt]}}."""
    args = {name: {"engine_kw": s["engine_kw"], "prompts": s["prompts"]} for name, s in models.items()}
    results = run_ranks(4, _ranks_main, (args, greedy(MAX_NEW)), timeout_s=540)
    errors = [r for r in results.values() if isinstance(r, str) and r.startswith(RANK_ERROR)]
    assert not errors, errors[0]
    assert sorted(results) == [0, 1, 2, 3], f"ranks that reported: {sorted(results)}"
    merged = {}
    for name in models:
        ep4 = {i: results[r][name]["ep4"][r] for r in range(4) for i in [r]}
        ep2 = {}
        for r in (0, 1):  # instance A: ranks 0 and 1 serve every prompt between them
            ep2.update(results[r][name]["ep2"])
        ep2_b = {}
        for r in (2, 3):
            ep2_b.update(results[r][name]["ep2"])
        n = len(models[name]["prompts"])
        merged[name] = {
            "ep4": [ep4[i] for i in range(n)],
            "ep2": [ep2[i] for i in range(n)],
            "ep2_b": [ep2_b[i] for i in range(n)],
            "dummy_b": results[2][name]["dummy_ep2"],
        }
    return merged


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["tiny", *CHECKPOINTS])
def test_ep2_and_ep4_equal_ep1(models, served, name):
    ref = models[name]["ep1"]
    assert served[name]["ep4"] == ref
    assert served[name]["ep2"] == ref
    assert served[name]["ep2_b"] == ref


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_ep1_equals_transformers(models, name):
    assert models[name]["ep1"] == models[name]["transformers"]


def test_a_rank_with_less_work_runs_dummy_steps(served):
    # instance B's rank 0 has one prompt of 3 tokens, its peer three: it idles through dummy steps
    assert served["tiny"]["dummy_b"] > 0
