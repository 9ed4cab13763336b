"""Entry frames catch every kind of damage; block keys are stable across processes and keep apart
what must not share KV (images, namespaces)."""

import multiprocessing as mp

import pytest
import torch

from deepinfer_core.kvstore import frame
from deepinfer_core.kvstore.identity import store_namespace
from deepinfer_core.kvstore.keys import placeholders_from_spans, sequence_keys
from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.sequence import Sequence
from deepinfer_core.transfer.layout import KVLayout
from deepinfer_core.transfer.messages import HandoffNotice

NS = b"n" * 16
KEY = b"k" * 16


def _slot(payload: bytes) -> memoryview:
    buf = bytearray(frame.HEADER_BYTES + len(payload))
    buf[frame.HEADER_BYTES :] = payload
    return memoryview(buf)


def test_a_sealed_frame_verifies():
    slot = _slot(bytes(range(200)))
    frame.seal(slot, KEY, NS)
    frame.verify(slot, KEY, NS)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda s: s.__setitem__(frame.HEADER_BYTES + 7, s[frame.HEADER_BYTES + 7] ^ 1), "checksum"),
        (lambda s: s.__setitem__(0, ord("X")), "magic"),
        (lambda s: s.__setitem__(8, 9), "version"),
    ],
    ids=["payload-bit", "magic", "version"],
)
def test_damage_is_caught(damage, message):
    slot = _slot(bytes(range(200)))
    frame.seal(slot, KEY, NS)
    damage(slot)
    with pytest.raises(frame.CorruptEntry, match=message):
        frame.verify(slot, KEY, NS)


def test_another_key_namespace_or_length_is_refused():
    slot = _slot(bytes(64))
    frame.seal(slot, KEY, NS)
    with pytest.raises(frame.CorruptEntry, match="key"):
        frame.verify(slot, b"j" * 16, NS)
    with pytest.raises(frame.CorruptEntry, match="model"):
        frame.verify(slot, KEY, b"m" * 16)
    with pytest.raises(frame.CorruptEntry, match="payload of"):
        frame.verify(slot[:-1], KEY, NS)  # a short read


def _seq(tokens, spans=()):
    seq = Sequence(0, "r", list(tokens), SamplingParams())
    seq.mm_placeholders = placeholders_from_spans(spans)
    return seq


def _keys_in_child(tokens, queue):
    queue.put(sequence_keys(_seq(tokens), 8, NS, len(tokens) // 8))


def test_keys_are_equal_in_another_process():
    tokens = list(range(40))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_keys_in_child, args=(tokens, queue))
    child.start()
    theirs = queue.get(timeout=120)
    child.join(30)
    assert theirs == sequence_keys(_seq(tokens), 8, NS, 5)


def test_two_images_with_equal_text_never_share_a_key_from_the_image_on():
    tokens = list(range(8)) + [1022] * 16 + list(range(100, 116))
    a = sequence_keys(_seq(tokens, [(8, 16, 111)]), 8, NS, 5)
    b = sequence_keys(_seq(tokens, [(8, 16, 222)]), 8, NS, 5)
    text_only = sequence_keys(_seq(tokens), 8, NS, 5)
    assert a[0] == b[0] == text_only[0]  # the block before the image is shared
    assert all(x != y for x, y in zip(a[1:], b[1:]))
    assert all(x != y for x, y in zip(a[1:], text_only[1:]))


def test_namespace_differs_by_dtype_block_size_seed_and_extra():
    from deepinfer_core.engine_args import EngineArgs

    def ns(dtype="float32", block_size=8, seed=0, extra=""):
        config = EngineArgs(device="cpu", dtype=dtype, block_size=block_size, seed=seed).create_engine_config()
        kv = torch.empty((3, 4, block_size, 48), dtype=config.model.dtype)
        return store_namespace(KVLayout.of(config.model.hf_config, kv, block_size), config.model, extra)

    base = ns()
    assert base == ns()
    others = [ns(dtype="bfloat16"), ns(block_size=16), ns(seed=1), ns(extra="adapter-a")]
    assert len({base, *others}) == 5


def test_the_handoff_notice_carries_cached_tokens_and_images_and_reads_as_before_without():
    plain = HandoffNotice("r", True, first_token=3, num_computed_tokens=9)
    assert b"image_spans" not in plain.to_bytes() and b"num_cached_tokens" not in plain.to_bytes()
    rich = HandoffNotice("r", True, 3, 9, num_cached_tokens=8, image_spans=[(1, 16, -(2**62))])
    assert HandoffNotice.from_bytes(rich.to_bytes()) == rich
