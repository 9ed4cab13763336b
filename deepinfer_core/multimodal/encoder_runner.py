"""A vision encoder process's engine: encoded images -> embeddings parked for prefill engines.

    bytes -> decode + preprocess (`preprocess`, any thread) -> pixels [3, S, S], content hash
    batch of pixels -> encoder cache lookup -> vision tower + projector on the misses (one forward)
                    -> each image's embeddings into the NIXL pool -> a lease (`EmbeddingHandle`)

`encode` runs on one thread (the encoder's). The content hash is the one an engine that
encodes in process gives the same pixels (`MultiModalProcessor.encode`), so both paths key the
prefix cache alike.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer_core.multimodal.embedding_handle import EmbeddingHandle
from deepinfer_core.multimodal.embedding_pool import EmbeddingPool
from deepinfer_core.multimodal.encoder_cache import EncoderCache
from deepinfer_core.multimodal.encoder_config import EncoderConfig
from deepinfer_core.multimodal.image_processor import ImageProcessorConfig, preprocess_image
from deepinfer_core.multimodal.inputs import content_hash


class VisionEncoderRunner:
    def __init__(self, encoder: nn.Module, image_config: ImageProcessorConfig, device, config: EncoderConfig):
        self.encoder = encoder
        self.image_config = image_config
        self.device = torch.device(device)
        self.config = config
        self.dtype = next(encoder.parameters()).dtype
        self.shape = (encoder.tokens_per_image, encoder.embed_dim)
        self.pool = EmbeddingPool(self.shape, self.dtype, config.pool_bytes, config.lease_s)
        self.cache = EncoderCache(config.cache_bytes)
        self.images_encoded = 0
        self.cache_hits = 0

    @classmethod
    def from_model_config(cls, model_config, device: str, config: EncoderConfig = EncoderConfig()):
        from deepinfer_core.models.loader import load_vision_encoder

        encoder = load_vision_encoder(model_config, device)
        image_config = ImageProcessorConfig.for_model(model_config.path, encoder.tower_type, encoder.image_size)
        return cls(encoder, image_config, device, config)

    def preprocess(self, image) -> tuple[torch.Tensor, int]:
        """(pixel values [3, S, S], content hash) of one encoded image; InvalidRequestError if it does not decode."""
        pixels = preprocess_image(image, self.image_config)
        return pixels, content_hash(pixels)

    @torch.inference_mode()
    def embed(self, items: list[tuple[torch.Tensor, int]]) -> list[torch.Tensor]:
        """Embeddings [P, H] (CPU) per (pixels, hash), in order: cached ones where the hash is
        known, one forward of the tower for the rest (a batch may hold several requests' images)."""
        embeds: dict[int, torch.Tensor] = {}
        for _, h in items:
            hit = self.cache.get(h)
            if hit is not None:
                embeds[h] = hit
        misses = {h: p for p, h in items if h not in embeds}
        self.cache_hits += len(items) - len(misses)
        if misses:
            out = self.encoder.encode_images(torch.stack(list(misses.values())).to(self.device))
            self.images_encoded += len(misses)
            for h, e in zip(misses, out.unbind(0)):
                embeds[h] = e.to("cpu").clone()
                self.cache.put(h, embeds[h])
        return [embeds[h] for _, h in items]

    def park(
        self, embeds: list[torch.Tensor], hashes: list[int], owner: str = "", lease_s: float = 0.0
    ) -> list[EmbeddingHandle]:
        """One request's images into the pool: a lease each (`EmbeddingPool.park`). Raises PoolFull
        (none left leased) when the pool has no room for all."""
        handles: list[EmbeddingHandle] = []
        try:
            for e, h in zip(embeds, hashes):
                handles.append(self.pool.park(e, h, owner, lease_s))
        except BaseException:
            for handle in handles:
                self.pool.release(handle.lease_id)
            raise
        return handles
