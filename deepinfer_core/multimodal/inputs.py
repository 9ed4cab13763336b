"""A request's images as the engine carries them: embeddings bound to prompt positions.

A prompt names each image with one placeholder token (`<|image|>`, `<image>`, ...); before
scheduling, each placeholder is expanded into `tokens_per_image` copies, and the image's
embeddings replace those copies' token embeddings at prefill. A prompt whose placeholders are
already expanded (runs of exactly `tokens_per_image`, as a router forwards them) is taken as is.

Prefix caching keys blocks by token ids; image positions hash by the image's content instead
(`ImagePlaceholder.hash_token`), so two prompts with different images never share KV blocks.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from deepinfer_core.errors import InvalidRequestError

_INT64 = 1 << 64
_GOLDEN = 0x9E3779B97F4A7C15  # spreads consecutive positions over the 64-bit range


@dataclass(frozen=True)
class ImagePlaceholder:
    """One image of a prompt."""

    offset: int  # prompt position of the image's first token
    length: int  # tokens the image occupies (= tokens_per_image)
    embeds: torch.Tensor  # [length, H]: fed in place of those tokens' embeddings
    content_hash: int  # signed 64-bit identity of the image's content

    def hash_token(self, index: int) -> int:
        """The stand-in token id of the image's `index`-th position for block hashing (signed 64-bit)."""
        v = (self.content_hash + (index + 1) * _GOLDEN) % _INT64
        return v - _INT64 if v >= 1 << 63 else v


def content_hash(t: torch.Tensor) -> int:
    """Signed 64-bit blake2b of a tensor's bytes (pixels or embeddings): equal content, equal hash."""
    data = t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def _runs(token_ids: list[int], token: int) -> list[tuple[int, int]]:
    """(start, length) of each maximal run of `token`."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(token_ids):
        if t != token:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def expand_image_placeholders(
    token_ids: list[int], image_token_id: int, tokens_per_image: int, num_images: int
) -> tuple[list[int], list[int]]:
    """(prompt with every placeholder expanded to `tokens_per_image` tokens, offset of each image).

    Raises:
        InvalidRequestError: the placeholders do not match the images in number (or in expanded length).
    """
    runs = _runs(token_ids, image_token_id)
    if len(runs) == num_images and all(n == tokens_per_image for _, n in runs):
        return list(token_ids), [start for start, _ in runs]
    count = sum(n for _, n in runs)
    if count != num_images or any(n != 1 for _, n in runs):
        raise InvalidRequestError(
            f"the prompt has {count} image placeholder token(s) (id {image_token_id}) but {num_images} image(s) "
            f"were given; put one placeholder per image (or {tokens_per_image} consecutive ones, pre-expanded)"
        )
    expanded: list[int] = []
    offsets: list[int] = []
    for t in token_ids:
        if t == image_token_id:
            offsets.append(len(expanded))
            expanded += [image_token_id] * tokens_per_image
        else:
            expanded.append(t)
    return expanded, offsets


def image_rows(placeholders: list[ImagePlaceholder], start: int, end: int) -> list[tuple[int, torch.Tensor]]:
    """For prompt positions [start, end) of one step: (first position, embeddings [n, H]) of every
    image slice they cover (a chunked prefill may cut an image in two)."""
    out = []
    for p in placeholders:
        lo, hi = max(start, p.offset), min(end, p.offset + p.length)
        if lo < hi:
            out.append((lo, p.embeds[lo - p.offset : hi - p.offset]))
    return out
