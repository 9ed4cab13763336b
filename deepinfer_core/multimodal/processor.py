"""Turns a request's `multi_modal_data` into the prompt layout and embeddings the engine runs.

    {"image": one or a list of images}       -> preprocess -> encoder.encode_images -> embeddings
    {"image_embeds": [N, P, H] or [[P, H]]}  -> embeddings computed elsewhere (a vision-encoder process)
      (+ "image_hashes": [N] ints)             -> with that process's content hash of each image, so the
                                                  prefix cache keys them as an in-process encode would

then expands the prompt's image placeholders (`multimodal.inputs`) and binds each image's
embeddings to its positions. The encoder is any module with `encode_images(pixel_values)`,
`image_token_id`, `tokens_per_image`, `image_size`, `tower_type` and `embed_dim` (a LLaVA-style
model or its `LlavaVisionEncoder`). Engines whose role has no multimodal pool build none.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from deepinfer_core.errors import InvalidRequestError
from deepinfer_core.multimodal.image_processor import ImageProcessorConfig, preprocess_images
from deepinfer_core.multimodal.inputs import ImagePlaceholder, content_hash, expand_image_placeholders

MODALITIES = ("image", "image_embeds")


class MultiModalProcessor:
    def __init__(self, encoder: nn.Module, image_config: ImageProcessorConfig, device: torch.device):
        self.encoder = encoder
        self.image_config = image_config
        self.device = device
        self.image_token_id: int = encoder.image_token_id
        self.tokens_per_image: int = encoder.tokens_per_image

    @classmethod
    def for_model(cls, model: nn.Module, model_dir: str, device: torch.device) -> Optional[MultiModalProcessor]:
        """The processor of a model that takes images; None for a text-only model."""
        if not hasattr(model, "encode_images"):
            return None
        config = ImageProcessorConfig.for_model(model_dir, model.tower_type, model.image_size)
        return cls(model, config, device)

    @torch.inference_mode()
    def encode(self, images: list[Any]) -> tuple[torch.Tensor, list[int]]:
        """Images -> (embeddings [N, P, H], a content hash per image)."""
        pixels = preprocess_images(images, self.image_config)  # [N, 3, S, S]
        embeds = self.encoder.encode_images(pixels.to(self.device))
        return embeds, [content_hash(p) for p in pixels]

    def _given_embeds(self, embeds: Any) -> tuple[list[torch.Tensor], list[int]]:
        items = list(embeds.unbind(0)) if isinstance(embeds, torch.Tensor) and embeds.dim() == 3 else list(embeds)
        want = (self.tokens_per_image, self.encoder.embed_dim)
        for i, e in enumerate(items):
            if not isinstance(e, torch.Tensor) or tuple(e.shape) != want:
                got = tuple(e.shape) if isinstance(e, torch.Tensor) else type(e).__name__
                raise InvalidRequestError(f"image_embeds[{i}] must be a tensor of shape {list(want)}, got {got}")
        return items, [content_hash(e) for e in items]

    def process(self, token_ids: list[int], data: dict[str, Any]) -> tuple[list[int], list[ImagePlaceholder]]:
        """(expanded prompt ids, one placeholder per image).

        Raises:
            InvalidRequestError: an unknown modality, not an image, or placeholders that do not match
                the images.
        """
        given_hashes = data.get("image_hashes")
        data = {k: v for k, v in data.items() if k != "image_hashes" or "image_embeds" not in data}
        unknown = sorted(set(data) - set(MODALITIES))
        if unknown or len(data) != 1:
            raise InvalidRequestError(f"multi_modal_data takes exactly one of {MODALITIES}, got {sorted(data)}")
        if "image_embeds" in data:
            embeds, hashes = self._given_embeds(data["image_embeds"])
            if given_hashes is not None:
                if len(given_hashes) != len(embeds):
                    raise InvalidRequestError(f"{len(given_hashes)} image_hashes for {len(embeds)} image_embeds")
                hashes = [int(h) for h in given_hashes]
        else:
            images = data["image"] if isinstance(data["image"], (list, tuple)) else [data["image"]]
            if not images:
                raise InvalidRequestError("multi_modal_data['image'] is empty")
            ids, _ = expand_image_placeholders(token_ids, self.image_token_id, self.tokens_per_image, len(images))
            stacked, hashes = self.encode(images)
            embeds = list(stacked.unbind(0))
        ids, offsets = expand_image_placeholders(token_ids, self.image_token_id, self.tokens_per_image, len(embeds))
        placeholders = [
            ImagePlaceholder(off, self.tokens_per_image, e.to(self.device), h)
            for off, e, h in zip(offsets, embeds, hashes)
        ]
        return ids, placeholders

    def check_text_only(self, token_ids: list[int]) -> None:
        """InvalidRequestError when a prompt without images still holds image placeholders."""
        count = token_ids.count(self.image_token_id)
        if count:
            raise InvalidRequestError(
                f"the prompt has {count} image placeholder token(s) (id {self.image_token_id}) but no images were given"
            )
