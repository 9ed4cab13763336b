"""The one-GPU wide-EP benchmark's steps at tiny widths on CPU: its shards split the token copies
exactly, the padded dispatch's round trip over a real (gloo) group returns what was sent, and
without CUDA the full-width mode refuses with a clear message."""

import pytest
import torch

from benchmarks.wide_ep_gpu import TINY, _one_rank_group, compute_rows, graph_check, main
from deepinfer_core.distributed.group import leave_instance


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_the_gpu_mode_refuses_without_cuda():
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        main([])


def test_every_token_copy_lands_on_exactly_one_shard():
    rows = compute_rows(TINY, [8], [2, 4], torch.device("cpu"), torch.float32, iters=1)
    copies = 8 * TINY["top_k"]
    by_layer = {r["layer"]: r for r in rows}
    assert by_layer["full, grouped GEMM"]["copies"] == copies
    for n in (2, 4):
        shard = by_layer[f"EP{n} shard (slowest of {n} ranks)"]
        assert shard["experts"] == TINY["experts"] // n
        assert shard["copies"] * n == copies and shard["copies_max"] >= shard["copies"]
    assert all(r["ms"] > 0 for r in rows)


def test_the_padded_round_trip_returns_what_was_sent():
    group = _one_rank_group("gloo")
    try:
        res = graph_check(group, TINY, 8, torch.device("cpu"), torch.float32, iters=1)
    finally:
        leave_instance()
    assert res["world"] == 1 and res["rows_per_peer"] == 8 * TINY["top_k"]
    assert res["dispatch + combine"]["round_trip_exact"] is True
    assert res["whole EP layer"]["eager_repeat"] == 0.0
    assert "need a GPU" in res["whole EP layer"]["graph"]
