"""The store outlives its engines: a new PE + CE pair on the same directory hits what an earlier pair
saved; under a small byte limit entries are evicted, outputs stay the NORMAL engine's and the
directory never holds more than the limit."""

import threading

import pytest
import torch

from benchmarks.pd_harness import PDPair
from tests.helpers.kv_store import directory_bytes, store_config, wait_store_idle
from tests.helpers.pd import ENGINE_ARGS, greedy, normal_reference

FRAME_BYTES = 4736  # 128-byte header + 3 layers x 8 tokens x 48 fp32 of the tiny model's latent cache
LIMIT = 24 * FRAME_BYTES + 100


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    return tmp_path_factory.mktemp("kv-store")


@pytest.fixture(scope="module")
def small_pair(directory):
    """A pair started apart from the one that writes first, on the same directory, with a small limit."""
    pair = PDPair({**ENGINE_ARGS, "kv_store": store_config(directory, l3_bytes=LIMIT)})
    yield pair
    pair.close()


def test_a_new_pair_on_the_same_directory_hits(directory, small_pair):
    prefix = _tokens(96, 1)
    first = PDPair({**ENGINE_ARGS, "kv_store": store_config(directory)})
    try:
        first.generate([prefix + [1, 2, 3]], greedy(4))
        wait_store_idle(first.ce)
    finally:
        first.close()
    prompt = prefix + [4, 5]
    (out,) = small_pair.generate([prompt], greedy(10))
    assert out.outputs[0].token_ids == normal_reference([prompt], greedy(10))[0]
    assert out.num_cached_tokens == 96 and small_pair.pe.call("kv_store_stats")["hit_tokens_l3"] == 96
    assert small_pair.pe.call("stats")["computed_prompt_tokens"] == 2


class _Watch:
    """Samples the directory's entry bytes in the background; `peak` is the most it saw."""

    def __init__(self, directory):
        self.directory, self.peak, self._stop = directory, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, directory_bytes(self.directory))
            self._stop.wait(0.005)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(10)
        return max(self.peak, directory_bytes(self.directory))


def test_eviction_under_pressure_keeps_outputs_and_the_limit(directory, small_pair):
    groups = [_tokens(48, 10 + g) for g in range(8)]  # 6 blocks each, saved with their outputs: 7 blocks
    prompts = [p + [g, 1] for g, p in enumerate(groups)]
    again = [p + [g, 2, 3] for g, p in enumerate(groups)]
    want = normal_reference(prompts + again, greedy(6))
    watch = _Watch(directory)
    outs = small_pair.generate(prompts, greedy(6))
    wait_store_idle(small_pair.ce)
    small_pair.restart_pe()  # a fresh PE: whatever it reuses comes from the store
    # The group saved last first, alone: it is still stored (what the others find depends on how
    # their own saves interleave with their lookups, and they evict each other).
    later = small_pair.generate(again[-1:], greedy(6))
    outs += small_pair.generate(again[:-1], greedy(6)) + later
    ce = wait_store_idle(small_pair.ce)
    pe = wait_store_idle(small_pair.pe)
    assert watch.stop() <= LIMIT
    assert [o.outputs[0].token_ids for o in outs] == want
    assert ce["evictions_l3"] > 0 and ce["l3_bytes"] <= LIMIT
    assert 48 <= pe["hit_tokens_l3"] < 8 * 48  # the group saved last was still there, not all were
