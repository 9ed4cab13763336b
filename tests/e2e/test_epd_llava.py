"""E/P/D equivalence on random LLaVA checkpoints saved with transformers (CLIP and SigLIP towers):
a chat with one image, with two images and text only, through `deepinfer serve` (a vision
encoder, a PE and a CE; embeddings over NIXL), gives the greedy tokens of the NORMAL engine in
this process and of transformers' `generate` on the same pixels. Two requests with the same
text and different images never share KV: each equals its own reference, and those differ."""

from __future__ import annotations

import shutil

import grpc
import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.builtin import TINY_MODEL_DIR
from deepinfer_core.multimodal.image_processor import load_image
from deepinfer_proto import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.helpers.cluster import SMALL_ENGINE, ServeProcess, wait_until
from tests.helpers.hf_models import HF_IMAGE_PROCESSORS, save_hf_llava
from tests.helpers.images import make_png

IMAGE_TOKEN = 1022  # the embedded tokenizer's image placeholder, which its chat template writes
MAX_NEW = 6
A, B = make_png(48, 40, seed=11), make_png(36, 50, seed=12)
CONVERSATIONS = {
    "one image": ["What is in", A, "?"],
    "two images": [B, "versus", A],
    "text only": ["Nothing to see"],
    "same text, other image": ["What is in", B, "?"],
}


@pytest.fixture(scope="module", params=["clip", "siglip"])
def served(request, cluster, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"llava-{request.param}")
    hf = save_hf_llava(path, vision=request.param, seed=5, text={"vocab_size": 1024}, image_token_index=IMAGE_TOKEN)
    processor = HF_IMAGE_PROCESSORS[request.param]()
    processor.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{TINY_MODEL_DIR}/{name}", path / name)
    serve = ServeProcess("--model", str(path), "--ray-address", cluster.ray_address, *SMALL_ENGINE[:4],
                         "--max-model-len", "256", "--dtype", "float32")  # fmt: skip
    try:
        llm = LLM(str(path), dtype="float32", max_model_len=256, num_gpu_blocks=64, block_size=16)
        yield serve, llm, hf, processor, request.param
    finally:
        serve.stop()


def _messages(parts) -> list[dict]:
    content = [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image", "image": p} for p in parts]
    return [{"role": "user", "content": content}]


def _served_tokens(serve: ServeProcess, parts) -> tuple[list[int], int]:
    proto_parts = [gateway_pb2.ContentPart(text=p) if isinstance(p, str) else gateway_pb2.ContentPart(image=p)
                   for p in parts]  # fmt: skip
    request = gateway_pb2.GenerateRequest(
        chat=gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role="user", parts=proto_parts)]),
        params=common_pb2.SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True),
    )
    with grpc.insecure_channel(serve.grpc_address) as ch:
        replies = list(gateway_pb2_grpc.GatewayStub(ch).Generate(request, timeout=120))
    return [t for r in replies for t in r.delta.token_ids], replies[-1].usage.prompt_tokens


def _hf_tokens(hf, processor, prompt: list[int], images: list[bytes]) -> list[int]:
    kwargs = {}
    if images:
        pixels = [processor(images=load_image(i), return_tensors="pt")["pixel_values"] for i in images]
        kwargs["pixel_values"] = torch.cat(pixels)
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                          pad_token_id=0, **kwargs)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def test_epd_equals_the_normal_engine_and_transformers(served):
    serve, llm, hf, processor, _ = served
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    got = {}
    for name, parts in CONVERSATIONS.items():
        tokens, prompt_tokens = _served_tokens(serve, parts)
        local = llm.chat(_messages(parts), greedy)[0]
        images = [p for p in parts if isinstance(p, bytes)]
        assert prompt_tokens == len(local.prompt_token_ids), name  # image tokens counted
        assert tokens == local.outputs[0].token_ids, name
        assert tokens == _hf_tokens(hf, processor, local.prompt_token_ids, images), name
        got[name] = tokens
    assert got["one image"] != got["same text, other image"]  # no KV shared across different images
    # a worker-load metric: the router reads the encoders' loads every 0.5 s
    assert wait_until(lambda: serve.metric("deepinfer:encoder_images_total") >= 2, timeout_s=10)
    assert serve.metric("deepinfer:embedding_transfer_seconds_count") >= 3


def test_scale_the_encoder_pool_live(served):
    """`deepinfer scale --encoder 2` starts a second vision encoder, `--encoder 1` drains one; images
    are served the same throughout (one tower is enough to check it)."""
    serve, llm, *_, vision = served
    if vision != "clip":
        pytest.skip("checked on the CLIP checkpoint")
    want = _served_tokens(serve, CONVERSATIONS["two images"])
    for size in (2, 1):
        r = serve.cli("scale", "--encoder", str(size), timeout_s=300)
        assert r.returncode == 0, r.stdout + r.stderr
        with grpc.insecure_channel(serve.grpc_address) as ch:
            status = gateway_pb2_grpc.ClusterStub(ch).Status(common_pb2.StatusRequest(), timeout=10)
        assert sum(len(p.workers) for p in status.pools if p.pool == common_pb2.POOL_ENCODER) == size
        assert _served_tokens(serve, CONVERSATIONS["two images"]) == want
