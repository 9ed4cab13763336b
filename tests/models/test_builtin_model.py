"""The embedded default model: a tiny DeepSeek-V3-architecture MoE language model (MLA, shared +
routed experts, grouped top-k) with a CLIP vision tower, LLaVA-style, weights from a fixed seed.

It is checked against transformers like any checkpoint: its seeded weights are exported under HF
names and loaded by `LlavaForConditionalGeneration.from_pretrained`; greedy generations, with and
without an image, must agree token for token (fp32).
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.builtin import TINY_MODEL_DIR
from deepinfer_core.config import ModelConfig
from deepinfer_core.models.deepseek_v3 import DeepseekV3ForCausalLM
from deepinfer_core.models.hf_config import load_hf_config
from deepinfer_core.models.llava import LlavaForConditionalGeneration
from deepinfer_core.models.loader import load_model
from deepinfer_core.multimodal.image_processor import load_image
from deepinfer_core.roles import EngineType
from tests.helpers.engines import copy_handoff, greedy, make_engine, run_to_completion
from tests.helpers.export import export_checkpoint, hf_llava_state_dict
from tests.helpers.images import make_png

IMAGE = 1022  # <|image|> in the shipped tokenizer
MAX_NEW = 8


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_model_len=256, num_gpu_blocks=64, block_size=8, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def hf(llm):
    """transformers' LLaVA built from the shipped config.json, holding the built-in seeded weights."""
    with open(f"{TINY_MODEL_DIR}/config.json", encoding="utf-8") as f:
        config = transformers.LlavaConfig.from_dict(json.load(f))
    model = transformers.LlavaForConditionalGeneration(config).eval()
    missing, unexpected = model.load_state_dict(hf_llava_state_dict(llm.engine.worker.model), strict=False)
    unused = {"model.vision_tower.post_layernorm.weight", "model.vision_tower.post_layernorm.bias"}  # CLIP's own head
    assert not unexpected and set(missing) == unused | {"lm_head.weight"}
    assert model.lm_head.weight is model.model.language_model.embed_tokens.weight  # tied, as configured
    model.generation_config.eos_token_id = None
    return model


def _hf_greedy(hf, ids: list[int], pixels: torch.Tensor | None = None) -> list[int]:
    kwargs = {} if pixels is None else {"pixel_values": pixels}
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0, **kwargs)
    return out[0, len(ids) :].tolist()


def test_default_is_a_deepseek_v3_moe_with_a_clip_tower(llm) -> None:
    model = llm.engine.worker.model
    assert isinstance(model, LlavaForConditionalGeneration)
    lm = model.language_model
    assert isinstance(lm, DeepseekV3ForCausalLM)
    assert [type(layer.mlp).__name__ for layer in lm.model.layers] == ["SwiGLUMLP", "SparseMoeBlock", "SparseMoeBlock"]
    moe = lm.model.layers[1].mlp
    assert moe.routing.topk_method == "noaux_tc" and moe.routing.n_group == 4 and moe.shared_experts is not None
    assert llm.engine.cache.kv_buffer.shape[2:] == (8, 32 + 16)  # one MLA latent per token
    assert model.tower_type == "clip_vision_model" and model.tokens_per_image == 16


def test_tokenizer_and_chat_template_carry_the_image_placeholder(llm) -> None:
    tok = llm.get_tokenizer()
    assert tok.bos_token_id == 1018 and tok.eos_token_id == 1019
    assert llm.engine.worker.model.image_token_id == IMAGE == tok.encode("<|image|>", add_special_tokens=False)[0]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True)
    assert text.count("<|image|>") == 1 and text.endswith("<|im_start|>assistant\n")


def test_builtin_weights_come_from_the_seed() -> None:
    hf_config = load_hf_config(TINY_MODEL_DIR)

    def weights(seed: int) -> dict[str, torch.Tensor]:
        config = ModelConfig(TINY_MODEL_DIR, hf_config, torch.float32, max_model_len=64, seed=seed, builtin=True)
        return load_model(config, "cpu").state_dict()

    first, again, other = weights(0), weights(0), weights(1)
    assert all(torch.equal(first[k], again[k]) for k in first)
    experts = "language_model.model.layers.1.mlp.experts.w13_weight"
    assert not torch.equal(first[experts], other[experts])
    assert first[experts].std().item() == pytest.approx(0.08, rel=0.05)  # the config's initializer_range


def test_text_generation_equals_transformers(llm, hf) -> None:
    prompts = [[1018, 5, 17, 200, 31], list(range(40, 90)), [7]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy())
    assert [o.outputs[0].token_ids for o in outs] == [_hf_greedy(hf, p) for p in prompts]


def test_chat_with_an_image_equals_transformers(llm, hf) -> None:
    png = make_png(45, 37, seed=9)
    messages = [{"role": "user", "content": [{"type": "image", "image": png}, {"type": "text", "text": "Describe."}]}]
    out = llm.chat(messages, _greedy())[0]
    assert out.prompt_token_ids.count(IMAGE) == 16
    processor = transformers.CLIPImageProcessorPil.from_pretrained(TINY_MODEL_DIR)
    pixels = processor(images=load_image(png), return_tensors="pt")["pixel_values"]
    assert out.outputs[0].token_ids == _hf_greedy(hf, out.prompt_token_ids, pixels)


def test_image_request_hands_off_from_prompt_to_completion_engine() -> None:
    """The PE computes the image into the latent KV; the CE decodes from that KV alone (its
    sequence has the expanded placeholders and no images) and matches a NORMAL engine."""
    png = make_png(seed=3)
    prompt = [1018, 5, IMAGE, 6, 7]
    normal = make_engine(EngineType.NORMAL)
    normal.add_request("r", params=greedy(6), prompt_token_ids=prompt, multi_modal_data={"image": png})
    want = run_to_completion(normal)["r"].outputs[0].token_ids
    pe, ce = make_engine(EngineType.PROMPT), make_engine(EngineType.COMPLETION)
    seq = pe.add_request("r", params=greedy(6), prompt_token_ids=prompt, multi_modal_data={"image": png})
    while not seq.output_token_ids:
        pe.step()
    assert seq.prompt_token_ids.count(IMAGE) == 16
    copy_handoff(pe, seq, ce, greedy(6))
    assert run_to_completion(ce)["r"].outputs[0].token_ids == want
    with pytest.raises(ValueError, match="no images were given"):  # computing that prompt needs the image
        normal.add_request("again", params=greedy(6), prompt_token_ids=seq.prompt_token_ids)


def test_builtin_weights_round_trip_as_a_checkpoint(llm, tmp_path) -> None:
    """Exported under HF checkpoint names (experts split per expert), the weights load back equal."""
    with open(f"{TINY_MODEL_DIR}/config.json", encoding="utf-8") as f:
        config = json.load(f)
    model = llm.engine.worker.model
    export_checkpoint(model, config, tmp_path)
    reloaded = load_model(ModelConfig(str(tmp_path), load_hf_config(str(tmp_path)), torch.float32, 64), "cpu")
    want, got = model.state_dict(), reloaded.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
