"""Images of a chat request: OpenAI `image_url` parts -> checked, encoded image files.

    {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}   -> the bytes
    {"type": "image_url", "image_url": {"url": "file:///dir/a.jpg"}}           -> under --allowed-media-dir only
    {"type": "image_url", "image_url": {"url": "https://..."}}                 -> only with --allow-media-fetch

Every image is opened with Pillow here (its size checked before its pixels are decoded, then
decoded in full, so a truncated file is refused now rather than by an engine) on a thread
pool: decoding never runs on the event loop. What goes on is the file as sent; the engine or
the vision encoder decodes it again for its preprocessing. Any refusal is a 400 naming the part.
The chat template renders each image part as the model's placeholder token; `expand` turns
each placeholder into the model's tokens per image, so lengths, the decode engine's reservation
and `usage.prompt_tokens` count image tokens.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import io
import os
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any, Optional

from services.common.errors import ErrorCode, ServiceError

IMAGE_PARTS = ("image_url", "image")
"""Content part types the chat template renders as an image placeholder."""
_DECODERS = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="image-decode")
"""Pillow releases the GIL while it decodes: two threads keep a burst of images off the event loop."""
_FETCH_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class MediaLimits:
    """What a request's images may be (`deepinfer serve` flags)."""

    max_images: int = 8
    """Images per request; more is a 400."""
    max_image_bytes: int = 8 * 1024 * 1024
    """Bytes of one encoded image."""
    max_image_pixels: int = 4096 * 4096
    """width * height of one image, checked before its pixels are decoded."""
    allowed_media_dir: Optional[str] = None
    """`file://` URLs are served from under this directory only; None refuses them."""
    allow_fetch: bool = False
    """Fetch `http(s)` URLs; off: they are refused."""


@dataclass(frozen=True)
class VisionInfo:
    """What the gateway needs to know of a model's vision tower."""

    image_token_id: int
    tokens_per_image: int

    @classmethod
    def from_model(cls, model_dir: str) -> Optional[VisionInfo]:
        """The vision tower of a checkpoint directory; None for a text-only model."""
        from deepinfer_core.models.hf_config import load_hf_config

        config = load_hf_config(model_dir)
        if not config.get("vision_config"):
            return None
        from deepinfer_core.models.llava import LlavaArgs

        args = LlavaArgs.from_hf(config)
        return cls(args.image_token_id, args.tokens_per_image)


def _bad(message: str, where: str) -> ServiceError:
    return ServiceError(ErrorCode.INVALID_ARGUMENT, message, where)


def image_urls(messages: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    """(where, url) of every image part, in order."""
    found = []
    for i, message in enumerate(messages):
        content = message.get("content")
        for j, part in enumerate(content if isinstance(content, list) else []):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in IMAGE_PARTS:
                value = part.get(kind)
                url = value.get("url") if isinstance(value, dict) else value
                found.append((f"messages[{i}].content[{j}]", url))
    return found


def _data_url(url: str, where: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise _bad(f"{where}: a data URL must be 'data:image/<type>;base64,<data>'", where)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise _bad(f"{where}: the data URL's base64 does not decode: {e}", where) from None


def _file_url(url: str, limits: MediaLimits, where: str) -> bytes:
    if limits.allowed_media_dir is None:
        raise _bad(f"{where}: file:// URLs are not allowed on this server (no --allowed-media-dir)", where)
    path = os.path.realpath(urllib.parse.unquote(urllib.parse.urlparse(url).path))
    root = os.path.realpath(limits.allowed_media_dir)
    if os.path.commonpath([path, root]) != root:
        raise _bad(f"{where}: {path!r} is outside the allowed media directory", where)
    if not os.path.isfile(path):
        raise _bad(f"{where}: no file {path!r}", where)
    if os.path.getsize(path) > limits.max_image_bytes:
        raise _bad(
            f"{where}: the image has {os.path.getsize(path)} bytes; the limit is {limits.max_image_bytes}", where
        )
    with open(path, "rb") as f:
        return f.read()


def _fetch(url: str, limits: MediaLimits, where: str) -> bytes:
    if not limits.allow_fetch:
        raise _bad(f"{where}: http(s) image URLs are not fetched by this server; send a data: URL", where)
    try:
        with urllib.request.urlopen(url, timeout=_FETCH_TIMEOUT_S) as response:
            return response.read(limits.max_image_bytes + 1)
    except OSError as e:
        raise _bad(f"{where}: fetching {url!r} failed: {e}", where) from None


def load_url(url: Any, limits: MediaLimits, where: str) -> bytes:
    """The encoded image a URL names (not yet checked as an image)."""
    if not isinstance(url, str) or not url:
        raise _bad(f"{where}: an image part needs a URL string", where)
    scheme = url.split(":", 1)[0].lower()
    if scheme == "data":
        return _data_url(url, where)
    if scheme == "file":
        return _file_url(url, limits, where)
    if scheme in ("http", "https"):
        return _fetch(url, limits, where)
    raise _bad(f"{where}: unsupported image URL scheme {scheme!r} (data:, file:// or http(s))", where)


def check_image(data: bytes, limits: MediaLimits, where: str) -> bytes:
    """`data` if it is one whole image within the limits (first frame of an animation)."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > limits.max_image_bytes:
        raise _bad(f"{where}: the image has {len(data)} bytes; the limit is {limits.max_image_bytes}", where)
    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size  # from the header: nothing decoded yet
            if width * height > limits.max_image_pixels:
                raise _bad(
                    f"{where}: the image has {width}x{height} pixels; the limit is {limits.max_image_pixels}", where
                )
            image.load()
    except Image.DecompressionBombError as e:
        raise _bad(f"{where}: the image is too large: {e}", where) from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise _bad(f"{where}: the image does not decode ({len(data)} bytes): {e}", where) from None
    return data


def _load_and_check(url: Any, limits: MediaLimits, where: str) -> bytes:
    return check_image(load_url(url, limits, where), limits, where)


async def chat_images(
    messages: list[dict[str, Any]], limits: MediaLimits, vision: Optional[VisionInfo], model: str
) -> list[bytes]:
    """The checked images of a conversation, in order (none: [])."""
    urls = image_urls(messages)
    if not urls:
        return []
    if vision is None:
        raise _bad(f"{urls[0][0]} is an image part, but the model {model!r} has no vision tower", urls[0][0])
    if len(urls) > limits.max_images:
        raise _bad(f"the request has {len(urls)} images; the limit is {limits.max_images}", "messages")
    loop = asyncio.get_running_loop()
    jobs = [loop.run_in_executor(_DECODERS, _load_and_check, url, limits, where) for where, url in urls]
    results = await asyncio.gather(*jobs, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return list(results)


def expand(prompt: list[int], vision: VisionInfo, num_images: int) -> list[int]:
    """The prompt with each image placeholder expanded to the model's tokens per image."""
    from deepinfer_core.errors import InvalidRequestError
    from deepinfer_core.multimodal.inputs import expand_image_placeholders

    try:
        ids, _ = expand_image_placeholders(prompt, vision.image_token_id, vision.tokens_per_image, num_images)
    except InvalidRequestError as e:
        raise _bad(str(e), "messages") from None
    return ids
