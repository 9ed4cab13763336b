"""LLaVA-style models against transformers: preprocessing, the vision encoder and generation with images.

Checkpoints are random tiny `LlavaForConditionalGeneration`s saved with `save_pretrained`, with
the HF image processor's `preprocessor_config.json` beside them; images are PNGs drawn by the
test (`tests.helpers.images`). Pixel values must equal HF's exactly, image embeddings within
fp32 atol 1e-5, and greedy generations token for token.

The reference processor is pinned to transformers' PIL backend (`CLIPImageProcessorPil`,
`SiglipImageProcessorPil`), which ours follows step for step. Where torchvision is installed,
`AutoImageProcessor` and `CLIPImageProcessor` default to the torchvision backend, whose
antialiased tensor resize differs from PIL's (on these images up to 2 uint8 levels for CLIP and
12 for SigLIP's squashing resize, transformers 5.17): not a target one implementation can equal.
Transparency: transformers 5.21 and later composite it onto white before resizing, as ours does;
5.20 and earlier drop the alpha channel (`Image.convert("RGB")`), so there the RGBA cases feed HF
the image already composited (see `_hf_composites_transparency`).

fp32 on CUDA runs with TF32 off for cuBLAS and cuDNN while this module runs (restored after), so
the GPU comparisons are exact fp32 ones too, whatever the process had set.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.builtin import TINY_MODEL_DIR
from deepinfer_core.models.loader import load_vision_encoder
from deepinfer_core.multimodal.image_processor import ImageProcessorConfig, load_image, preprocess_images
from tests.helpers.hf_models import HF_IMAGE_PROCESSORS, IMAGE_TOKEN_ID, model_config_for, save_hf_llava
from tests.helpers.images import make_png

MAX_NEW = 8
PROCESSORS = HF_IMAGE_PROCESSORS
# (vision tower, language model): DeepSeek-V3 + CLIP is the built-in model's composition
COMPOSITIONS = [("clip", "deepseek_v3"), ("siglip", "llama")]


@pytest.fixture(scope="module", autouse=True)
def full_fp32_on_cuda():
    """No TF32 while this module runs (cuDNN's fp32 convolutions default to it): fp32 is fp32."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture(scope="module", params=COMPOSITIONS, ids=lambda c: f"{c[0]}-{c[1]}")
def checkpoint(request, tmp_path_factory):
    vision, text = request.param
    path = tmp_path_factory.mktemp(f"llava-{vision}-{text}")
    hf = save_hf_llava(path, text_family=text, vision=vision, seed=5)
    processor = PROCESSORS[vision]()
    processor.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{TINY_MODEL_DIR}/{name}", path / name)
    return str(path), hf, processor


@pytest.fixture(scope="module")
def llm(checkpoint):
    path, _, _ = checkpoint
    return LLM(path, dtype="float32", max_model_len=128, num_gpu_blocks=64, block_size=8)


def _hf_pixels(processor, png: bytes | Image.Image) -> torch.Tensor:
    return processor(images=load_image(png), return_tensors="pt")["pixel_values"]


def _on_white(image: Image.Image) -> Image.Image:
    rgba = image.convert("RGBA")
    return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")


def _hf_composites_transparency(processor) -> bool:
    """Whether the installed transformers composites transparency onto white (5.21 and later) rather
    than dropping the alpha channel (5.20 and earlier): a clear black image comes out white or black."""
    clear = Image.new("RGBA", (32, 32), (0, 0, 0, 0))
    return torch.equal(_hf_pixels(processor, clear), _hf_pixels(processor, Image.new("RGB", (32, 32), "white")))


def _hf_greedy(hf, prompt: list[int], pixels: torch.Tensor | None, tokens_per_image: int) -> list[int]:
    expanded = [t for tok in prompt for t in ([tok] * tokens_per_image if tok == IMAGE_TOKEN_ID else [tok])]
    kwargs = {} if pixels is None else {"pixel_values": pixels}
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([expanded]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=0,
            **kwargs,
        )  # fmt: skip
    return out[0, len(expanded) :].tolist()


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.mark.parametrize("mode,size", [("RGB", (48, 40)), ("RGBA", (30, 61)), ("RGB", (20, 20))])
@pytest.mark.parametrize("vision", ["clip", "siglip"])
def test_preprocessing_equals_hf_image_processor(tmp_path, vision, mode, size) -> None:
    """Resize (aspect kept or squashed), crop (padded when the image is small), transparency onto white."""
    processor = PROCESSORS[vision]()
    processor.save_pretrained(tmp_path)
    tower = {"clip": "clip_vision_model", "siglip": "siglip_vision_model"}[vision]
    config = ImageProcessorConfig.for_model(str(tmp_path), tower, 32)
    png = make_png(*size, seed=1, mode=mode)
    ours = preprocess_images([png], config)
    assert ours.dtype == torch.float32 and ours.shape == (1, 3, 32, 32)
    image = load_image(png)
    if mode == "RGBA":
        assert 0 < np.asarray(image.getchannel("A")).min() < 255  # partial transparency to composite
        if not _hf_composites_transparency(processor):  # transformers <= 5.20: HF gets it composited
            image = _on_white(image)
    assert torch.equal(ours, _hf_pixels(processor, image))


def test_encode_images_equals_hf_vision_tower_and_projector(checkpoint, llm) -> None:
    path, hf, processor = checkpoint
    pngs = [make_png(seed=2), make_png(52, 33, seed=3)]
    ours, _ = llm.engine.mm_processor.encode(pngs)
    pixels = torch.cat([_hf_pixels(processor, p) for p in pngs])
    with torch.inference_mode():
        ref = torch.stack(list(hf.model.get_image_features(pixel_values=pixels).pooler_output))
    assert ours.shape == ref.shape == (2, llm.engine.mm_processor.tokens_per_image, hf.config.text_config.hidden_size)
    if ours.is_cuda:  # fp32 both, TF32 off (fixture); CUDA's GEMM/attention kernels sum in another order
        torch.testing.assert_close(ours.cpu(), ref, atol=1e-4, rtol=1e-4)
    else:
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)
    alone = load_vision_encoder(model_config_for(path), "cpu")  # what a vision-encoder process loads
    assert not hasattr(alone, "language_model")
    with torch.inference_mode():
        torch.testing.assert_close(alone.encode_images(pixels), ref, atol=1e-5, rtol=0)


def test_generation_with_one_image_equals_transformers(checkpoint, llm) -> None:
    _, hf, processor = checkpoint
    png = make_png(seed=4)
    prompt = [5, 6, IMAGE_TOKEN_ID, 7, 8, 9]
    out = llm.generate([{"prompt_token_ids": prompt, "multi_modal_data": {"image": png}}], _greedy())[0]
    n = llm.engine.mm_processor.tokens_per_image
    assert len(out.prompt_token_ids) == len(prompt) - 1 + n  # the placeholder expanded
    assert out.outputs[0].token_ids == _hf_greedy(hf, prompt, _hf_pixels(processor, png), n)


def _run_resumed(llm, request_id: str, prompt: list[int], resumed_tokens: int, images=None):
    """A migrated sample's continuation: `prompt` ends in `resumed_tokens` tokens of output so far."""
    mm = {"image": images} if images else None
    llm.engine.add_request(
        request_id, params=_greedy(), prompt_token_ids=prompt, multi_modal_data=mm, resumed_tokens=resumed_tokens
    )
    done = None
    while llm.engine.has_unfinished_requests():
        done = next((o for o in llm.engine.step() if o.request_id == request_id and o.finished), done)
    return done


def test_a_continuation_takes_its_resumed_output_as_plain_tokens(checkpoint, llm) -> None:
    """A model may generate the placeholder id. A migrated sample's prompt then holds it in its
    resumed output: a plain token there, embedded as the text model does, with no image wanted."""
    _, hf, processor = checkpoint
    text = [5, 6, 7, IMAGE_TOKEN_ID, 9]
    with pytest.raises(ValueError, match="but no images were given"):  # in the prompt proper: refused
        llm.generate([{"prompt_token_ids": text}], _greedy())
    out = _run_resumed(llm, "resumed-text", text, resumed_tokens=2)
    assert out.prompt_token_ids == text
    assert out.outputs[0].token_ids == _hf_greedy(hf, text, None, tokens_per_image=1)  # no expansion

    png = make_png(seed=4)
    with_image = [5, IMAGE_TOKEN_ID, 7, IMAGE_TOKEN_ID, 9]  # one image; the second id is output so far
    out = _run_resumed(llm, "resumed-image", with_image, resumed_tokens=2, images=png)
    n = llm.engine.mm_processor.tokens_per_image
    assert out.prompt_token_ids == [5] + [IMAGE_TOKEN_ID] * n + [7, IMAGE_TOKEN_ID, 9]
    assert len(out.outputs[0].token_ids) == MAX_NEW
    with pytest.raises(ValueError, match="resumed_tokens=5 must leave at least one"):
        llm.engine.add_request("too-many", params=_greedy(), prompt_token_ids=text, resumed_tokens=5)
    assert not llm.engine.has_unfinished_requests()


def test_mixed_batch_of_images_and_text_equals_transformers(checkpoint) -> None:
    """Two prompts with the same tokens but different images (they must not share KV blocks
    through the prefix cache), a two-image prompt and a text-only prompt, in one batch, with
    chunked prefill cutting through the images; then a repeat of the first hits the cache."""
    path, hf, processor = checkpoint
    llm = LLM(path, dtype="float32", max_model_len=128, num_gpu_blocks=64, block_size=8, chunked_prefill=True,
              max_num_batched_tokens=12)  # fmt: skip
    a, b = make_png(seed=5), make_png(40, 44, seed=6)
    same = [3, 4, 5, 6, 7, 8, 9, 10, IMAGE_TOKEN_ID, 11, 12]
    two = [13, IMAGE_TOKEN_ID, 14, IMAGE_TOKEN_ID, 15]
    text = [21, 22, 23, 24, 25]
    requests = [
        {"prompt_token_ids": same, "multi_modal_data": {"image": a}},
        {"prompt_token_ids": same, "multi_modal_data": {"image": [b]}},
        {"prompt_token_ids": two, "multi_modal_data": {"image": [b, a]}},
        {"prompt_token_ids": text},
    ]
    outs = llm.generate(requests, _greedy())
    n = llm.engine.mm_processor.tokens_per_image
    pa, pb = _hf_pixels(processor, a), _hf_pixels(processor, b)
    want = [
        _hf_greedy(hf, same, pa, n),
        _hf_greedy(hf, same, pb, n),
        _hf_greedy(hf, two, torch.cat([pb, pa]), n),
        _hf_greedy(hf, text, None, n),
    ]
    assert [o.outputs[0].token_ids for o in outs] == want
    assert want[0] != want[1]
    again = llm.generate([requests[0]], _greedy())[0]
    assert again.num_cached_tokens >= 8 and again.outputs[0].token_ids == want[0]


def test_precomputed_image_embeddings_equal_raw_image(checkpoint, llm) -> None:
    """A prefill engine fed embeddings from a vision-encoder process generates what it would from the image."""
    path, _, _ = checkpoint
    png = make_png(seed=7)
    encoder = load_vision_encoder(model_config_for(path), "cpu")
    pixels = preprocess_images([png], llm.engine.mm_processor.image_config)
    with torch.inference_mode():
        embeds = encoder.encode_images(pixels)  # [1, P, H]
    prompt = [9, IMAGE_TOKEN_ID, 8]
    from_image = llm.generate([{"prompt_token_ids": prompt, "multi_modal_data": {"image": png}}], _greedy())
    from_embeds = llm.generate([{"prompt_token_ids": prompt, "multi_modal_data": {"image_embeds": embeds}}], _greedy())
    assert from_embeds[0].outputs[0].token_ids == from_image[0].outputs[0].token_ids


# --- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "image,message",
    [
        (b"\x89PNG\r\n\x1a\n but truncated", "cannot decode the image data"),
        (b"GIF89a? no, just text", "cannot decode the image data"),
        (12345, "not an image: got int"),
        ("/nonexistent/cat.png", "does not exist"),
        ("data:image/png;base64,@@@", "not a base64 data URL"),
    ],
)
def test_not_an_image_is_a_clear_error(llm, image, message) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate([{"prompt_token_ids": [1, IMAGE_TOKEN_ID, 2], "multi_modal_data": {"image": image}}], _greedy())
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "prompt,images,message",
    [
        ([1, IMAGE_TOKEN_ID, IMAGE_TOKEN_ID, 2], 1, "2 image placeholder token"),
        ([1, 2, 3], 1, "0 image placeholder token"),
        ([1, IMAGE_TOKEN_ID, 2, IMAGE_TOKEN_ID], 3, "but 3 image"),
        ([1, IMAGE_TOKEN_ID, 2], 0, "but no images were given"),
    ],
)
def test_wrong_number_of_placeholders_is_a_clear_error(llm, prompt, images, message) -> None:
    request = {"prompt_token_ids": prompt}
    if images:
        request["multi_modal_data"] = {"image": [make_png(seed=i) for i in range(images)]}
    with pytest.raises(ValueError, match=message):
        llm.generate([request], _greedy())


def test_bad_multimodal_payloads_are_clear_errors(llm) -> None:
    prompt = [1, IMAGE_TOKEN_ID, 2]
    with pytest.raises(ValueError, match="multi_modal_data takes exactly one of"):
        llm.generate([{"prompt_token_ids": prompt, "multi_modal_data": {"video": b""}}], _greedy())
    with pytest.raises(ValueError, match=r"image_embeds\[0\] must be a tensor of shape"):
        llm.generate([{"prompt_token_ids": prompt, "multi_modal_data": {"image_embeds": torch.zeros(1, 3, 4)}}])
    with pytest.raises(ValueError, match="pixel_values of shape"):
        llm.engine.mm_processor.encoder.encode_images(torch.zeros(1, 3, 16, 16))


def test_images_to_a_text_only_model_are_refused(tmp_path) -> None:
    from tests.helpers.hf_models import save_hf_checkpoint

    save_hf_checkpoint("llama", tmp_path)
    text_only = LLM(str(tmp_path), tokenizer=TINY_MODEL_DIR, max_model_len=64, num_gpu_blocks=16, block_size=8)
    assert text_only.engine.mm_processor is None
    with pytest.raises(ValueError, match="takes no images"):
        text_only.generate([{"prompt_token_ids": [1, 2], "multi_modal_data": {"image": Image.new("RGB", (8, 8))}}])
