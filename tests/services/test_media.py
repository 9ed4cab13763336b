"""The gateway's image parts as plain units (the e2e matrix covers HTTP): every format and URL
form that is accepted, every limit and every refusal, each a 400 naming the part."""

from __future__ import annotations

import asyncio
import base64
import io
import os

import pytest
from PIL import Image

from deepinfer_core.builtin import TINY_MODEL_DIR
from deepinfer_core.tokenizer import load_tokenizer
from services.common.errors import ServiceError
from services.gateway.core import GatewayConfig, GatewayCore
from services.gateway.media import MediaLimits, VisionInfo
from tests.helpers.images import make_png

VISION = VisionInfo.from_model(TINY_MODEL_DIR)


def _core(vision=VISION, **limits) -> GatewayCore:
    config = GatewayConfig("tiny", 512, media=MediaLimits(**limits), vision=vision)
    return GatewayCore(config, load_tokenizer(TINY_MODEL_DIR), router=None)


def _encoded(fmt: str, size=(20, 16)) -> bytes:
    frames = [Image.new("RGB", size, c) for c in ("red", "blue")]
    buf = io.BytesIO()
    frames[0].save(buf, format=fmt, **({"save_all": True, "append_images": frames[1:]} if fmt == "GIF" else {}))
    return buf.getvalue()


def _chat(*urls) -> list[dict]:
    parts = [{"type": "text", "text": "look"}] + [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": parts}]


def _data(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _encode(core, messages):
    return asyncio.run(core.encode_chat(messages))


def _refused(core, messages) -> ServiceError:
    with pytest.raises(ServiceError) as e:
        _encode(core, messages)
    assert e.value.http_status == 400
    return e.value


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_each_format_is_taken_and_its_placeholder_expanded(fmt):
    data = _encoded(fmt)
    prompt, images = _encode(_core(), _chat(_data(data)))
    assert images == [data]
    assert prompt.count(VISION.image_token_id) == VISION.tokens_per_image  # usage counts these


def test_file_urls_only_under_the_allowed_directory(tmp_path):
    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "a.png").write_bytes(make_png(seed=1))
    (tmp_path / "secret.png").write_bytes(make_png(seed=2))
    os.symlink(tmp_path / "secret.png", allowed / "link.png")
    core = _core(allowed_media_dir=str(allowed))
    assert _encode(core, _chat(f"file://{allowed}/a.png"))[1] == [make_png(seed=1)]
    for url in (f"file://{tmp_path}/secret.png", f"file://{allowed}/../secret.png", f"file://{allowed}/link.png"):
        assert "outside the allowed media directory" in _refused(core, _chat(url)).message
    assert "no --allowed-media-dir" in _refused(_core(), _chat(f"file://{allowed}/a.png")).message


def test_limits_and_refusals_name_the_part():
    png = make_png(40, 40, seed=3)
    cases = [
        (_core(max_image_bytes=len(png) - 1), _chat(_data(png)), "bytes; the limit is"),
        (_core(max_image_pixels=40 * 40 - 1), _chat(_data(png)), "pixels; the limit is"),
        (_core(max_images=1), _chat(_data(png), _data(png)), "the request has 2 images; the limit is 1"),
        (_core(), _chat("https://example.com/a.png"), "not fetched"),
        (_core(), _chat(_data(png[:100])), "does not decode"),
        (_core(vision=None), _chat(_data(png)), "has no vision tower"),
    ]
    for core, messages, words in cases:
        error = _refused(core, messages)
        assert words in error.message, error.message
        assert error.param in ("messages[0].content[1]", "messages"), error.param
