"""P/D on GPUs: a PE on one device sending KV in layer groups (per-layer CUDA events) and streamed
chunks to a CE process on another; its greedy outputs must equal a NORMAL engine's token for token.
On CPU the same paths run with stand-in events (test_pd_invariants); here the events are real."""

import pytest
import torch

from deepinfer_core import envs
from tests.helpers.pd import greedy, local_pe, normal_reference, reserve, run_pe, start_ce, wait_ce

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GPU = dict(device="cuda:0", dtype="float32", num_gpu_blocks=512, max_model_len=512)


@pytest.mark.parametrize("chunk", [0, 48])
def test_layer_group_and_streamed_hand_offs_equal_normal_on_gpus(monkeypatch, chunk):
    monkeypatch.setattr(envs, "DEEPINFER_PD_LAYER_GROUPS", 2)
    ce_device = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    sched = dict(chunked_prefill=True, max_num_batched_tokens=chunk) if chunk else {}
    ce = start_ce(**{**GPU, "device": ce_device})
    try:
        pe = local_pe(**GPU, **sched)
        assert pe.worker.runner.want_layer_events and len(pe._layer_groups) == 2
        pe.connect_peer(ce.info["agent_name"], ce.info["agent_metadata"], ce.info["kv_region"])
        prompts = [list(range(1, 200)), [5, 6, 7], list(range(300, 390)), list(range(7, 140, 2))]
        ids = [f"gpu-{chunk}-{i}" for i in range(len(prompts))]
        for rid, p in zip(ids, prompts):
            pe.add_prefill(rid, reserve(ce, rid, p, greedy(8)), greedy(8), p)
        results = run_pe(pe)
        assert len(results) == len(prompts) and all(r.ok for r in results), [r.error for r in results]
        done = wait_ce(ce, ids)
        expected = normal_reference(prompts, greedy(8), **GPU, **sched)
        assert [done[i].outputs[0].token_ids for i in ids] == expected
    finally:
        ce.close()
