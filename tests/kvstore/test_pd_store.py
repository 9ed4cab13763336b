"""The KV store between real processes: a CE saves what a PE computed, another PE (fresh: nothing of the
prompt in its prefix cache or pool) loads it and computes only the rest, with the NORMAL engine's
greedy output; damaged entries are recomputed; two images with equal text never share KV; and
after many requests and aborts nothing stays pinned or in flight."""

import os
import time

import pytest
import torch

from deepinfer_core import LLM
from deepinfer_core.roles import EngineType
from tests.helpers.images import make_png
from tests.helpers.kv_store import connect, start_engine, store_config, submit, wait_store_idle
from tests.helpers.pd import ENGINE_ARGS, greedy, normal_reference, wait_ce

BS = 8
IMAGE_TOKEN, TOKENS_PER_IMAGE = 1022, 16


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One CE saving to the store, a writer PE without one, a reader PE loading from it."""
    store = store_config(tmp_path_factory.mktemp("kv-store"))
    ce = start_engine(EngineType.COMPLETION, num_gpu_blocks=512, kv_store=store)
    writer = start_engine(EngineType.PROMPT)
    reader = start_engine(EngineType.PROMPT, kv_store=store)
    for pe in (writer, reader):
        connect(pe, ce)
    yield ce, writer, reader, store.directory
    for engine in (reader, writer, ce):
        engine.close()


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


_ids = iter(range(10**6))


def _run(pe, ce, prompts, params, images=None) -> list:
    rids = [f"kv-{next(_ids)}" for _ in prompts]
    for rid, prompt, image in zip(rids, prompts, images or [None] * len(prompts)):
        submit(pe, ce, rid, prompt, params, {"image": image} if image is not None else None)
    done = wait_ce(ce, rids)
    return [done[r] for r in rids]


def _warm(cluster, prompts, params=None):
    """The writer computes `prompts`; returns once the CE has written their blocks."""
    ce, writer, _, _ = cluster
    outs = _run(writer, ce, prompts, params or greedy(4))
    wait_store_idle(ce)
    return outs


def _delta(reader, before, key):
    return reader.call("stats")[key] - before[key]


def test_a_fresh_pe_computes_only_the_suffix_with_normal_output(cluster):
    ce, _, reader, _ = cluster
    prefix = _tokens(120, 1)
    first, second = prefix + [5, 6, 7], prefix + [9, 10, 11, 12, 13]
    _warm(cluster, [first])
    before = reader.call("stats")
    (out,) = _run(reader, ce, [second], greedy(10))
    assert out.outputs[0].token_ids == normal_reference([second], greedy(10))[0]
    assert _delta(reader, before, "computed_prompt_tokens") == len(second) - 120  # 15 blocks loaded
    assert out.num_cached_tokens == 120  # usage.cached_tokens counts every token not computed
    stats = wait_store_idle(reader)
    assert stats["hit_tokens_l3"] >= 120 and stats["corrupt_entries"] == 0


def _damage(path: str, how: str) -> None:
    if how == "flip":
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) - 3)
            byte = f.read(1)[0]
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte ^ 0x55]))
    else:
        os.truncate(path, os.path.getsize(path) - 100)


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_a_damaged_entry_is_counted_and_recomputed_with_identical_output(cluster, how):
    ce, _, reader, _ = cluster
    prompt = _tokens(80, 2 if how == "flip" else 3)
    _warm(cluster, [prompt])
    _damage(reader.call("kv_store_paths", prompt)[4], how)  # block 4 of 10: the load stops there
    before = reader.call("stats")
    corrupt_before = reader.call("kv_store_stats")["corrupt_entries"]
    (out,) = _run(reader, ce, [prompt + [1, 2]], greedy(8))
    assert out.outputs[0].token_ids == normal_reference([prompt + [1, 2]], greedy(8))[0]
    assert wait_store_idle(reader)["corrupt_entries"] == corrupt_before + 1
    assert out.num_cached_tokens == 4 * BS and _delta(reader, before, "computed_prompt_tokens") == 82 - 4 * BS


def _image_prompt(prefix: list[int], suffix: list[int]) -> list[int]:
    return prefix + [IMAGE_TOKEN] * TOKENS_PER_IMAGE + suffix


def test_two_images_with_equal_text_never_share_stored_kv(cluster):
    ce, writer, reader, _ = cluster
    prompt = _image_prompt(_tokens(40, 4), _tokens(40, 5))  # the image covers blocks 5 and 6
    image_a, image_b = make_png(seed=1), make_png(seed=2)
    _run(writer, ce, [prompt], greedy(4), images=[image_a])
    wait_store_idle(ce)
    (with_b,) = _run(reader, ce, [prompt], greedy(8), images=[image_b])
    assert with_b.num_cached_tokens == 40  # the text before the image only: image A's blocks are not B's
    (with_a,) = _run(reader, ce, [prompt + [7]], greedy(8), images=[image_a])
    assert with_a.num_cached_tokens == 96  # its prefix cache's 5 text blocks, then image A's from the store
    llm = LLM(**ENGINE_ARGS)
    want = llm.generate(
        [
            {"prompt_token_ids": prompt, "multi_modal_data": {"image": image_b}},
            {"prompt_token_ids": prompt + [7], "multi_modal_data": {"image": image_a}},
        ],
        greedy(8),
    )
    assert [with_b.outputs[0].token_ids, with_a.outputs[0].token_ids] == [o.outputs[0].token_ids for o in want]


def test_no_pins_or_loads_left_after_many_requests_and_aborts(cluster):
    ce, _, reader, _ = cluster
    shared = _tokens(64, 6)
    _warm(cluster, [shared + [1]])
    free_ce, free_pe = ce.call("stats")["free_blocks"], reader.call("stats")["free_blocks"]
    hits_before = reader.call("kv_store_stats")["hit_tokens"]
    g = torch.Generator().manual_seed(7)
    rids = []
    for i in range(24):  # store hits, misses, and aborts while loading, prefilling or decoding
        tail = torch.randint(0, 1000, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g).tolist()
        prompt = (shared if i % 2 else _tokens(64, 100 + i)) + tail
        rid = f"mix-{i}"
        submit(reader, ce, rid, prompt, greedy(int(torch.randint(1, 12, (1,), generator=g))))
        rids.append(rid)
        if i % 5 == 4:
            reader.call("abort", rids[-2])
            ce.call("abort", rids[-3])
    deadline = time.monotonic() + 120
    while reader.call("stats")["requests"] or ce.call("stats")["requests"]:
        assert time.monotonic() < deadline, "requests never drained"
        ce.call("collect")
        reader.call("collect")
        time.sleep(0.02)
    for engine in (reader, ce):
        stats = wait_store_idle(engine)
        assert stats["l2_pins"] == 0 and stats["inflight_loads"] == 0 and stats["inflight_saves"] == 0
    assert wait_store_idle(reader)["hit_tokens"] - hits_before >= 64  # the shared prefix came from the store
    assert reader.call("stats")["loading"] == 0
    _settle_blocks(reader, free_pe)
    _settle_blocks(ce, free_ce, grace=True)


def _settle_blocks(engine, expected: int, grace: bool = False, timeout_s: float = 60.0) -> None:
    """Free blocks come back (a CE's aborted leases stay quarantined for their grace period first)."""
    deadline = time.monotonic() + timeout_s
    while engine.call("stats")["free_blocks"] < expected and not (grace and engine.call("stats")["quarantined"]):
        assert time.monotonic() < deadline, "blocks never came back"
        time.sleep(0.02)
