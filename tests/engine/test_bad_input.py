"""Bad input is refused with a clear ValueError / FileNotFoundError naming the problem."""

import pytest

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.builtin import TINY_MODEL_DIR


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=64, num_gpu_blocks=64, block_size=8, device="cpu")


@pytest.mark.parametrize("prompt", ["", [[]], {"prompt_token_ids": []}])
def test_empty_prompt(llm, prompt):
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate(prompt)


def test_prompt_longer_than_max_model_len(llm):
    with pytest.raises(ValueError, match="max_model_len is 64"):
        llm.generate({"prompt_token_ids": [5] * 80})


def test_token_ids_outside_the_vocabulary(llm):
    with pytest.raises(ValueError, match="out of the vocabulary"):
        llm.generate({"prompt_token_ids": [5, 99999]})


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(n=0), "n"),
    ],
)
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_engine_is_still_usable_after_refusals(llm):
    with pytest.raises(ValueError):
        llm.generate(["ok prompt", ""])
    out = llm.generate("ok prompt", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
    assert not llm.engine.has_unfinished_requests()


def test_unknown_model_path():
    with pytest.raises(FileNotFoundError, match="/no/such/model"):
        LLM("/no/such/model")


def test_corrupted_safetensors(tmp_path):
    import shutil

    from tests.helpers.hf_models import save_hf_checkpoint

    save_hf_checkpoint("llama", tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{TINY_MODEL_DIR}/{name}", tmp_path / name)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors"):
        LLM(str(tmp_path), num_gpu_blocks=16)


def test_unsupported_architecture(tmp_path):
    import json
    import shutil

    shutil.copytree(TINY_MODEL_DIR, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["MambaForCausalLM"], "mamba"
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="Mamba"):
        LLM(str(tmp_path / "m"), num_gpu_blocks=16)


def test_bad_engine_args():
    with pytest.raises(ValueError, match="block_size"):
        LLM(block_size=12)
    with pytest.raises(ValueError, match="dtype"):
        LLM(dtype="float8")
    with pytest.raises(ValueError, match="chunked_prefill"):
        LLM(max_model_len=256, max_num_batched_tokens=64)
