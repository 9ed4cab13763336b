"""A stored block's key: the chain hash of its full token block, the namespace and extra keys.

    key_i = blake2b-128(namespace | chain_hash_i | content hashes of the images inside block i)

`chain_hash_i` is the prefix cache's own hash (`scheduler.block_manager.block_hash`): it covers
every token up to the end of block i, with image positions standing for their image's content,
so it is equal across processes and restarts for equal prompts. The image hashes are named again
as extra keys so that a block holding an image never matches one that does not, whatever the
hashing of image positions becomes. The namespace (`identity.store_namespace`) keeps models,
weights, dtypes and block sizes apart.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable

import torch

from deepinfer_core.multimodal.inputs import ImagePlaceholder
from deepinfer_core.scheduler.block_manager import chain_hashes
from deepinfer_core.sequence import Sequence

KEY_BYTES = 16


def block_key(namespace: bytes, chain_hash: int, image_hashes: Iterable[int] = ()) -> bytes:
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    h.update(namespace)
    h.update(struct.pack("<q", chain_hash))
    for image in image_hashes:
        h.update(struct.pack("<q", image))
    return h.digest()


def images_in_block(seq: Sequence, index: int, block_size: int) -> list[int]:
    """Content hashes of the images with a position in block `index` of `seq`."""
    start, end = index * block_size, (index + 1) * block_size
    return [p.content_hash for p in seq.mm_placeholders if p.offset < end and p.offset + p.length > start]


def sequence_keys(seq: Sequence, block_size: int, namespace: bytes, num_blocks: int) -> list[bytes]:
    """Keys of `seq`'s first `num_blocks` full blocks."""
    hashes = chain_hashes(seq, block_size, num_blocks)
    return [block_key(namespace, h, images_in_block(seq, i, block_size)) for i, h in enumerate(hashes)]


def image_spans(seq: Sequence) -> list[tuple[int, int, int]]:
    """(offset, length, content hash) of each image: what another engine needs to key the same blocks."""
    return [(p.offset, p.length, p.content_hash) for p in seq.mm_placeholders]


def placeholders_from_spans(spans: Iterable[tuple[int, int, int]]) -> list[ImagePlaceholder]:
    """Images known by position and content hash only (an engine that keys blocks but never embeds them)."""
    return [ImagePlaceholder(int(o), int(n), torch.empty(0), int(h)) for o, n, h in spans]
