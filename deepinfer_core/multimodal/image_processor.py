"""Image preprocessing as a checkpoint's `preprocessor_config.json` describes it (CLIP / SigLIP style).

    decode -> RGB (transparency composited onto white) -> resize (PIL, the configured filter)
           -> center crop (zero-padded when the image is smaller) -> rescale -> normalise
           -> pixel_values [N, 3, H, W] fp32

The arithmetic follows transformers' PIL backend step for step (PIL resize on uint8 pixels,
rescale in float64 then float32, normalise in float32), so pixel values equal HF's.
Accepted images: a `PIL.Image.Image`, encoded bytes (PNG, JPEG, ...), a file path, a
`data:image/...;base64,` URL, or a uint8 array [H, W, 3]. Anything else is a clear ValueError.
"""

from __future__ import annotations

import base64
import io
import json
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from deepinfer_core.errors import InvalidRequestError

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
PREPROCESSOR_FILE = "preprocessor_config.json"


def _size_dict(size: Any, square: bool) -> dict[str, int]:
    """HF's `size` spellings: an int means the shortest edge (CLIP) or a square (SigLIP)."""
    if isinstance(size, int):
        return {"height": size, "width": size} if square else {"shortest_edge": size}
    if isinstance(size, (list, tuple)) and len(size) == 2:
        return {"height": int(size[0]), "width": int(size[1])}
    if isinstance(size, dict) and ("shortest_edge" in size or {"height", "width"} <= size.keys()):
        return {k: int(v) for k, v in size.items() if v is not None}
    raise ValueError(f"unsupported image size setting {size!r}: use shortest_edge or height and width")


@dataclass(frozen=True)
class ImageProcessorConfig:
    size: dict[str, int]  # {"shortest_edge": n} or {"height": h, "width": w}
    crop_size: dict[str, int] = field(default_factory=dict)  # {"height": h, "width": w}
    resample: int = Image.Resampling.BICUBIC  # PIL filter id (HF stores the same integers)
    do_convert_rgb: bool = True
    do_resize: bool = True
    do_center_crop: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD

    @classmethod
    def from_dict(cls, d: dict[str, Any], square: bool = False) -> ImageProcessorConfig:
        """From the keys of a preprocessor_config.json (unknown keys are ignored)."""
        crop = d.get("crop_size")
        return cls(
            size=_size_dict(d.get("size", 224), square),
            crop_size=_size_dict(crop, True) if crop is not None else {},
            resample=int(d.get("resample", Image.Resampling.BICUBIC)),
            do_convert_rgb=bool(d.get("do_convert_rgb", True)),
            do_resize=bool(d.get("do_resize", True)),
            do_center_crop=bool(d.get("do_center_crop", crop is not None)),
            do_rescale=bool(d.get("do_rescale", True)),
            rescale_factor=float(d.get("rescale_factor", 1 / 255)),
            do_normalize=bool(d.get("do_normalize", True)),
            image_mean=tuple(d.get("image_mean", OPENAI_CLIP_MEAN)),
            image_std=tuple(d.get("image_std", OPENAI_CLIP_STD)),
        )

    @classmethod
    def for_tower(cls, tower_type: str, image_size: int) -> ImageProcessorConfig:
        """What a CLIP / SigLIP checkpoint's processor does when the checkpoint ships no config."""
        if tower_type == "siglip_vision_model":
            return cls(
                size={"height": image_size, "width": image_size},
                resample=Image.Resampling.BICUBIC,
                do_center_crop=False,
                image_mean=(0.5, 0.5, 0.5),
                image_std=(0.5, 0.5, 0.5),
            )
        return cls(size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size})

    @classmethod
    def for_model(cls, model_dir: str, tower_type: str, image_size: int) -> ImageProcessorConfig:
        path = os.path.join(model_dir, PREPROCESSOR_FILE)
        if not os.path.isfile(path):
            return cls.for_tower(tower_type, image_size)
        try:
            with open(path, encoding="utf-8") as f:
                return cls.from_dict(json.load(f), square=tower_type == "siglip_vision_model")
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None


def load_image(image: Any) -> Image.Image:
    """A decoded PIL image from any accepted input (see the module doc).

    Raises:
        InvalidRequestError: the input is not an image or cannot be decoded.
    """
    if isinstance(image, Image.Image):
        return image
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim not in (2, 3):
            raise InvalidRequestError(
                f"an image array must be uint8 [H, W] or [H, W, C], got {image.dtype} {image.shape}"
            )
        return Image.fromarray(image)
    if isinstance(image, str) and image.startswith("data:"):
        try:
            image = base64.b64decode(image.split(",", 1)[1], validate=True)
        except (IndexError, ValueError) as e:
            raise InvalidRequestError(f"not a base64 data URL of an image: {e}") from None
    if isinstance(image, (str, os.PathLike)):
        if not os.path.isfile(image):
            raise InvalidRequestError(f"image file {str(image)!r} does not exist")
        with open(image, "rb") as f:
            image = f.read()
    if isinstance(image, (bytes, bytearray, memoryview)):
        try:
            decoded = Image.open(io.BytesIO(bytes(image)))
            decoded.load()
        except (UnidentifiedImageError, OSError, SyntaxError) as e:
            raise InvalidRequestError(f"cannot decode the image data ({len(image)} bytes): {e}") from None
        return decoded
    raise InvalidRequestError(
        f"not an image: got {type(image).__name__}; pass a PIL image, encoded bytes, a file path, "
        "a data URL or a uint8 array"
    )


def _to_rgb(image: Image.Image) -> Image.Image:
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def _resize_to(image: Image.Image, size: dict[str, int]) -> tuple[int, int]:
    """(height, width) after resizing."""
    if "shortest_edge" in size:
        w, h = image.size
        short, long = (w, h) if w <= h else (h, w)
        new_short, new_long = size["shortest_edge"], int(size["shortest_edge"] * long / short)
        return (new_long, new_short) if w <= h else (new_short, new_long)
    return size["height"], size["width"]


def _center_crop(x: np.ndarray, height: int, width: int) -> np.ndarray:  # [C, H, W]
    h, w = x.shape[-2:]
    top, left = (h - height) // 2, (w - width) // 2
    if top >= 0 and left >= 0:
        return x[:, top : top + height, left : left + width]
    out = np.zeros((x.shape[0], max(h, height), max(w, width)), dtype=x.dtype)
    pad_top, pad_left = -(-(out.shape[1] - h) // 2), -(-(out.shape[2] - w) // 2)
    out[:, pad_top : pad_top + h, pad_left : pad_left + w] = x
    return _center_crop(out, height, width)


def preprocess_image(image: Any, cfg: ImageProcessorConfig) -> torch.Tensor:
    """One image -> pixel values [3, H, W] fp32."""
    pil = load_image(image)
    pil = _to_rgb(pil) if cfg.do_convert_rgb else pil
    if cfg.do_resize:
        h, w = _resize_to(pil, cfg.size)
        pil = pil.resize((w, h), resample=cfg.resample)
    x = np.array(pil)
    x = x[None] if x.ndim == 2 else np.moveaxis(x, -1, 0)  # [C, H, W]
    if cfg.do_center_crop and cfg.crop_size:
        x = _center_crop(x, cfg.crop_size["height"], cfg.crop_size["width"])
    if cfg.do_rescale:
        x = (x.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
    x = x.astype(np.float32)
    if cfg.do_normalize:
        mean = np.array(cfg.image_mean, dtype=np.float32)[:, None, None]
        std = np.array(cfg.image_std, dtype=np.float32)[:, None, None]
        x = (x - mean) / std
    return torch.from_numpy(np.ascontiguousarray(x))


def preprocess_images(images: list[Any], cfg: ImageProcessorConfig) -> torch.Tensor:
    """Images -> pixel values [N, 3, H, W] fp32 (every image ends at the same size)."""
    return torch.stack([preprocess_image(im, cfg) for im in images])
