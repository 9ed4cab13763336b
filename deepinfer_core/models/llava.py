"""LLaVA-style vision-language models: a CLIP/SigLIP tower, a projector and any language model here.

    image [N, 3, S, S] -> vision tower -> hidden states of `vision_feature_layer`(s)
                       -> drop CLS ("default" strategy) -> concat layers -> projector (linear, act, linear)
                       -> [N, tokens_per_image, H_text]: one embedding per image placeholder token

`LlavaVisionEncoder` is the vision half alone (`encode_images`), loadable by itself from the same
checkpoint: a vision-encoder process runs it and ships the embeddings. The full model adds the
language model (`language_model`, any architecture of the registry: Llama, Qwen, DeepSeek-V3, ...)
and runs like it, taking image embeddings in place of the placeholder tokens' embeddings
(`inputs_embeds`, filled by the model runner).

Checkpoint names are accepted in both spellings transformers writes: the classic
`language_model.model.*` / `vision_tower.vision_model.*` and the newer `model.language_model.*` /
`model.vision_tower.*` / `lm_head.weight`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from deepinfer_core.models.hf_config import normalize_hf_config
from deepinfer_core.models.layers.attention import AttentionMetadata
from deepinfer_core.models.registry import get_model_class
from deepinfer_core.models.vision.vit import VisionTransformer, ViTArgs, activation
from deepinfer_core.models.weights import expected_weight_names, load_weights_by_name

SELECT_STRATEGIES = ("default", "full")


@dataclass(frozen=True)
class LlavaArgs:
    vision: ViTArgs
    text_hidden_size: int
    image_token_id: int
    feature_layers: list[int]  # indices into the tower's hidden states, 0..num_layers
    select_strategy: str  # "default": drop the CLS token; "full": keep every token
    projector_act: str
    projector_bias: bool

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> LlavaArgs:
        vision = ViTArgs.from_hf(cfg.get("vision_config") or {})
        strategy = cfg.get("vision_feature_select_strategy", "default")
        if strategy not in SELECT_STRATEGIES:
            raise ValueError(f"unsupported vision_feature_select_strategy {strategy!r}; supported: {SELECT_STRATEGIES}")
        layers = cfg.get("vision_feature_layer", -2)
        layers = [layers] if isinstance(layers, int) else list(layers)
        n = vision.num_layers
        resolved = [i if i >= 0 else n + 1 + i for i in layers]
        if not all(0 <= i <= n for i in resolved):
            raise ValueError(f"vision_feature_layer {layers} is outside the tower's {n} layers")
        image_token = cfg.get("image_token_id", cfg.get("image_token_index"))
        if image_token is None:
            raise ValueError("a LLaVA config needs image_token_index (the image placeholder token id)")
        return cls(
            vision=vision,
            text_hidden_size=cfg["text_config"]["hidden_size"],
            image_token_id=int(image_token),
            feature_layers=resolved,
            select_strategy=strategy,
            projector_act=cfg.get("projector_hidden_act", "gelu"),
            projector_bias=bool(cfg.get("multimodal_projector_bias", True)),
        )

    @property
    def tokens_per_image(self) -> int:
        keep_cls = self.vision.has_cls_token and self.select_strategy == "full"
        return self.vision.num_patches + int(keep_cls)


class LlavaProjector(nn.Module):
    def __init__(self, args: LlavaArgs, dtype: torch.dtype):
        super().__init__()
        d_in = args.vision.hidden_size * len(args.feature_layers)
        self.linear_1 = nn.Linear(d_in, args.text_hidden_size, bias=args.projector_bias, dtype=dtype)
        self.act = activation(args.projector_act)
        self.linear_2 = nn.Linear(args.text_hidden_size, args.text_hidden_size, bias=args.projector_bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, P, Dv * layers] -> [N, P, H]
        return self.linear_2(self.act(self.linear_1(x)))


def _canonical(name: str) -> str:
    """One spelling for both checkpoint layouts (see the module doc)."""
    if name == "lm_head.weight":
        return "language_model.lm_head.weight"
    if name.startswith("model.language_model."):
        return "language_model.model." + name[len("model.language_model.") :]
    if name.startswith("model."):
        name = name[len("model.") :]
    return name.replace("vision_tower.vision_model.", "vision_tower.", 1)


class LlavaVisionEncoder(nn.Module):
    """The vision tower and projector: `encode_images(pixel_values) -> [N, tokens_per_image, H]`."""

    def __init__(self, hf_config: dict[str, Any], dtype: torch.dtype):
        super().__init__()
        self.llava_args = LlavaArgs.from_hf(hf_config)
        a = self.llava_args
        self.vision_tower = VisionTransformer(a.vision, max(a.feature_layers), dtype)
        self.multi_modal_projector = LlavaProjector(a, dtype)
        # what a multimodal processor needs to know (see multimodal.processor)
        self.image_token_id = a.image_token_id
        self.tokens_per_image = a.tokens_per_image
        self.image_size = a.vision.image_size
        self.tower_type = a.vision.model_type
        self.embed_dim = a.text_hidden_size

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, 3, S, S] (preprocessed) -> image embeddings [N, tokens_per_image, H_text]."""
        features = self.vision_tower(pixel_values, self.llava_args.feature_layers)  # [N, P(+1), Dv] each
        if self.llava_args.select_strategy == "default":
            features = [f[:, 1:] for f in features]
        return self.multi_modal_projector(torch.cat(features, dim=-1))

    def _rename_vision(self, name: str) -> str | None:
        """Canonical name of a vision tensor, None for the tower parts not built (or not vision)."""
        if name.startswith("multi_modal_projector."):
            return name
        if not name.startswith("vision_tower."):
            return None
        if name.startswith("vision_tower.encoder.layers."):
            layer = int(name.split(".")[3])
            return name if layer < len(self.vision_tower.encoder.layers) else None
        if name.startswith(("vision_tower.post_layernorm.", "vision_tower.head.")) or name.endswith("position_ids"):
            return None  # parts LLaVA does not use; position_ids: a buffer older checkpoints saved
        return name

    def holds_weight(self, name: str) -> bool:
        """Whether checkpoint tensor `name` belongs to this encoder (the loader reads only those)."""
        return self._rename_vision(_canonical(name)) is not None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Vision tensors only; the language model's tensors are consumed without a copy."""
        return load_weights_by_name(self, weights, lambda n: self._rename_vision(_canonical(n)))

    def expected_weight_names(self) -> list[str]:
        return expected_weight_names(self)


class LlavaForConditionalGeneration(LlavaVisionEncoder):
    """Vision encoder + language model; runs on the paged cache exactly like its language model."""

    def __init__(self, hf_config: dict[str, Any], dtype: torch.dtype):
        super().__init__(hf_config, dtype)
        text_config = normalize_hf_config(hf_config["text_config"])
        self.language_model = get_model_class(text_config)(text_config, dtype)
        lm = self.language_model
        self.num_kv_cache_layers = lm.num_kv_cache_layers
        self.max_positions = getattr(lm, "max_positions", None)
        self.sliding_window = getattr(lm, "sliding_window", None)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],
        attn_meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,  # [T, H]: token embeddings with images filled in
    ) -> torch.Tensor:  # [T, H]
        return self.language_model(input_ids, positions, kv_caches, attn_meta, inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_input_ids(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    def kv_cache_block_shape(self, block_size: int) -> tuple[int, ...]:
        return self.language_model.kv_cache_block_shape(block_size)

    def _rename(self, name: str) -> str | None:
        name = _canonical(name)
        if not name.startswith("language_model."):
            return self._rename_vision(name)
        inner = name[len("language_model.") :]
        lm = self.language_model
        rename = getattr(lm, "_rename", None)
        if rename is not None:
            inner = rename(inner)
        elif inner == "lm_head.weight" and lm.args.tie_word_embeddings:
            inner = None
        return None if inner is None else "language_model." + inner

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_weights_by_name(self, weights, self._rename)
