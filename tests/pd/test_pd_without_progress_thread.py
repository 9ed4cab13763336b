"""Hand-offs when no NIXL progress thread runs (a PE with a GPU cache runs without one): the
engines drive the transfer plane between steps, and every request still completes, token for
token, here with neither engine's thread."""

import pytest
import torch

from tests.helpers.nixl import require_nixl  # noqa: E402

require_nixl()

from benchmarks.pd_harness import PDPair  # noqa: E402
from deepinfer_core import envs  # noqa: E402
from deepinfer_core.transfer.agent_settings import wants_progress_thread  # noqa: E402
from tests.helpers.pd import ENGINE_ARGS, greedy, normal_reference, wait_free_blocks  # noqa: E402


@pytest.mark.parametrize(
    "setting, mem, sends, want",
    [
        ("auto", "VRAM", True, False),  # a PE with a GPU cache polls its own writes
        ("auto", "VRAM", False, True),  # a CE answers at once
        ("auto", "DRAM", True, True),
        ("1", "VRAM", True, True),
        ("0", "DRAM", False, False),
        ("off", "VRAM", False, False),
    ],
)
def test_who_gets_a_progress_thread(monkeypatch, setting, mem, sends, want):
    monkeypatch.setattr(envs, "DEEPINFER_NIXL_PROGRESS_THREAD", setting)
    assert wants_progress_thread(mem, sends) is want


def test_a_bad_setting_is_refused(monkeypatch):
    monkeypatch.setattr(envs, "DEEPINFER_NIXL_PROGRESS_THREAD", "sometimes")
    with pytest.raises(ValueError, match="auto, 1 or 0"):
        wants_progress_thread("DRAM", True)


@pytest.fixture(scope="module")
def pair():
    mp = pytest.MonkeyPatch()
    mp.setenv("DEEPINFER_NIXL_PROGRESS_THREAD", "0")  # both engine processes inherit it
    try:
        p = PDPair(ENGINE_ARGS, pe_args=dict(chunked_prefill=True, max_num_batched_tokens=32))
    finally:
        mp.undo()
    yield p
    p.close()


def test_hand_offs_without_a_progress_thread_equal_normal(pair):
    assert pair.pe.call("stats")["progress_thread"] is False
    assert pair.ce.call("stats")["progress_thread"] is False
    free_pe, free_ce = pair.pe.call("stats")["free_blocks"], pair.ce.call("stats")["free_blocks"]
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (3, 8, 41, 97)]
    want = normal_reference(prompts, greedy(10))
    (one,) = pair.generate([prompts[2]], greedy(10))  # alone: the PE idles right after its notice
    assert one.outputs[0].token_ids == want[2]
    outs = pair.generate(prompts, greedy(10))  # concurrent, the long ones chunked on the PE
    assert [o.outputs[0].token_ids for o in outs] == want
    assert wait_free_blocks(pair.pe, free_pe) == free_pe
    assert wait_free_blocks(pair.ce, free_ce) == free_ce
