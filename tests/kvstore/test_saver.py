"""The CE's save policy: finished sequences hand over their computed full blocks once, long-running ones
every K blocks, nothing past the computed KV, and nothing whose images are unknown."""

import torch

from deepinfer_core.kvstore.keys import placeholders_from_spans
from deepinfer_core.kvstore.saver import StoreSaver
from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.sequence import Sequence, SequenceStatus
from tests.helpers.kv_store import cpu_store, entry_files, settle

BS = 8


def _seq(seq_id: int, tokens: list[int], cached: int, blocks: list[int]) -> Sequence:
    seq = Sequence(seq_id, f"r{seq_id}", tokens, SamplingParams())
    seq.num_cached_tokens, seq.block_table = cached, blocks
    return seq


def test_a_finished_sequence_saves_its_computed_full_blocks_once(tmp_path):
    store = cpu_store(tmp_path)
    saver = StoreSaver(store, BS, every_blocks=0)
    seq = _seq(1, list(range(30)), cached=29, blocks=[3, 4, 5, 6])  # block 3 holds an uncomputed token
    saver.on_step([seq], [])
    settle(store)
    assert store.stats().saved_blocks == 0  # running: saved only when it finishes
    seq.status = SequenceStatus.FINISHED_LENGTH
    saver.on_step([], [seq])
    settle(store)
    assert store.stats().saved_blocks == 3 and len(entry_files(tmp_path)) == 3
    assert torch.equal(
        store.pool.payload_rows[:3].view(torch.float32).view(3, 3, 8, 6), store.kv[:, 3:6].transpose(0, 1)
    )


def test_a_long_running_sequence_saves_every_k_blocks(tmp_path):
    store = cpu_store(tmp_path)
    saver = StoreSaver(store, BS, every_blocks=2)
    seq = _seq(1, list(range(60)), cached=8, blocks=list(range(8)))
    saved = []
    for cached in (8, 15, 16, 23, 40, 47):
        seq.num_cached_tokens = cached
        saver.on_step([seq], [])
        settle(store)
        saved.append(store.stats().saved_blocks)
    assert saved == [0, 0, 2, 2, 5, 5]
    seq.status, seq.num_cached_tokens = SequenceStatus.FINISHED_STOPPED, 59
    saver.on_step([], [seq])
    settle(store)
    assert store.stats().saved_blocks == 7 and saver.num_tracked == 0


def test_a_sequence_with_unknown_images_is_not_saved(tmp_path):
    store = cpu_store(tmp_path)
    saver = StoreSaver(store, BS, every_blocks=0, image_token_id=1022)
    tokens = [1] * 8 + [1022] * 16 + [2] * 8
    blind = _seq(1, tokens, cached=32, blocks=[0, 1, 2, 3])
    known = _seq(2, tokens, cached=32, blocks=[4, 5, 6, 7])
    known.mm_placeholders = placeholders_from_spans([(8, 16, 12345)])
    for seq in (blind, known):
        seq.status = SequenceStatus.FINISHED_LENGTH
    saver.on_step([], [blind, known])
    settle(store)
    assert store.stats().saved_blocks == 4  # the known one's only
