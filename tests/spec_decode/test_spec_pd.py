"""MTP drafting across the P/D hand-off: a PE (no draft weights) hands the prompt's last hidden
state to a CE that drafts from its first decode step; greedy output equals the NORMAL engine's,
and every block is back on both sides afterwards. Real processes and NIXL transfers."""

import pytest
import torch

from benchmarks.pd_harness import PDPair
from deepinfer_core.spec_decode.handoff import decode_hidden, encode_hidden
from deepinfer_core.transfer.messages import HandoffNotice
from tests.helpers.pd import ENGINE_ARGS, greedy, normal_reference, wait_free_blocks


def _prompts():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (3, 9, 30)]


@pytest.fixture(scope="module")
def pair():
    p = PDPair(ENGINE_ARGS, ce_args=dict(num_speculative_tokens=2), pe_args=dict(num_speculative_tokens=2))
    yield p
    p.close()


def test_notice_carries_the_last_hidden_state():
    h = torch.randn(16)
    notice = HandoffNotice.from_bytes(HandoffNotice("r", True, 5, 3, last_hidden=encode_hidden(h)).to_bytes())
    assert torch.equal(decode_hidden(notice.last_hidden, torch.device("cpu"), torch.float32), h)
    assert b"last_hidden" not in HandoffNotice("r", True, 5, 3).to_bytes()  # older readers see no new key


def test_ce_drafts_from_its_first_decode_step(pair):
    # Token 1 comes from the PE. With 3 tokens asked, only the CE's first decode step may verify a
    # draft (one: it can emit two tokens); a CE without the PE's hidden state would have none then.
    (out,) = pair.generate([_prompts()[1]], greedy(3))
    assert out.outputs[0].token_ids == normal_reference([_prompts()[1]], greedy(3))[0]
    assert pair.ce.call("stats")["spec_draft_tokens"] == 1


def test_greedy_through_pd_equals_normal(pair):
    want = normal_reference(_prompts(), greedy(14))
    outs = pair.generate(_prompts(), greedy(14))
    assert [o.outputs[0].token_ids for o in outs] == want
    ce = pair.ce.call("stats")
    assert ce["spec_draft_tokens"] > 0
    assert wait_free_blocks(pair.ce, ce["num_blocks"]) == ce["num_blocks"]
    pe = pair.pe.call("stats")
    assert wait_free_blocks(pair.pe, pe["num_blocks"]) == pe["num_blocks"]
