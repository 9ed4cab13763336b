"""The MTP layer of a DeepSeek-V3 checkpoint (random, saved with transformers): its logits equal a
hand-written reference built on transformers' own decoder layer (transformers has no MTP module),
and greedy output with MTP drafts equals greedy output without, token for token."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.builtin import TINY_MODEL_DIR
from deepinfer_core.engine.llm_engine import LLMEngine
from deepinfer_core.engine_args import EngineArgs
from deepinfer_core.roles import EngineType
from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.sequence import Sequence
from deepinfer_core.spec_decode.decoder import draft_metadata
from tests.helpers.engines import copy_handoff, greedy, prefill_on, run_to_completion
from tests.helpers.hf_models import save_hf_checkpoint, save_hf_deepseek_mtp
from tests.helpers.spec import oracle_drafts, role_environment

N_LAYERS = 3
PROMPTS = [[3, 14, 15, 92, 65], [200 + i for i in range(19)]]


@pytest.fixture(scope="module", autouse=True)
def _env():
    with role_environment():
        yield


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("dsv3_mtp")
    return path, save_hf_deepseek_mtp(path, seed=7)


def _engine(path, nextn: int, role: EngineType = EngineType.NORMAL) -> LLMEngine:
    args = EngineArgs(model=str(path), tokenizer=TINY_MODEL_DIR, device="cpu", dtype="float32", num_gpu_blocks=64, block_size=8,
                      max_model_len=128, num_speculative_tokens=nextn, engine_type=role,
                      stop_preempted_request=role == EngineType.COMPLETION)  # fmt: skip
    return LLMEngine.from_engine_args(args)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _reference_mtp_logits(hf, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(target hidden h [T, H] of the N-layer model, MTP logits [T-1, V] at positions 0..T-2)."""
    x = hf.mtp_extra
    ids = torch.tensor([tokens])
    with torch.inference_mode():
        states = hf.model(ids, output_hidden_states=True).hidden_states
        h = hf.model.norm(states[N_LAYERS])[0]  # the N-layer target's last hidden state
        e = _rms(hf.model.embed_tokens(ids[0, 1:]), x["enorm.weight"])
        z = torch.cat([e, _rms(h[:-1], x["hnorm.weight"])], dim=-1) @ x["eh_proj.weight"].T  # [T-1, H]
        pos = torch.arange(len(tokens) - 1)[None]
        mask = torch.full((len(tokens) - 1,) * 2, float("-inf")).triu(1)[None, None]
        out = hf.model.layers[N_LAYERS](z[None], attention_mask=mask, position_ids=pos,
                                        position_embeddings=hf.model.rotary_emb(z[None], pos))  # fmt: skip
        out = out[0] if isinstance(out, tuple) else out
        logits = _rms(out[0], x["shared_head.norm.weight"]) @ x["shared_head.head.weight"].T
    return h, logits


def test_mtp_logits_equal_reference(checkpoint):
    path, hf = checkpoint
    tokens = [5, 77, 13, 200, 31, 8, 99, 150, 42, 7, 3]
    h, ref = _reference_mtp_logits(hf, tokens)
    engine = _engine(path, nextn=1)
    mtp = engine.worker.draft
    seq = Sequence(0, "ref", tokens, SamplingParams())
    seq.block_table = [0, 1]
    meta, positions = draft_metadata([seq], [0], [len(tokens) - 1], 8, torch.device("cpu"))
    with torch.inference_mode():
        out = mtp(torch.tensor(tokens[1:]), positions, h[:-1], engine.cache.draft_kv_caches[0], meta)
        logits = mtp.compute_logits(out)
    torch.testing.assert_close(logits, ref, atol=2e-4, rtol=2e-4)


@pytest.fixture(scope="module")
def reference(checkpoint) -> dict[str, list[int]]:
    return _generate(_engine(checkpoint[0], nextn=0))


def _generate(engine: LLMEngine, n: int = 16) -> dict[str, list[int]]:
    for j, p in enumerate(PROMPTS):
        engine.add_request(f"r{j}", params=greedy(n), prompt_token_ids=p)
    return {rid: o.outputs[0].token_ids for rid, o in run_to_completion(engine).items()}


def test_greedy_with_mtp_equals_without(checkpoint, reference):
    engine = _engine(checkpoint[0], nextn=2)
    assert _generate(engine) == reference
    assert engine.spec.slots.stats.draft_tokens > 0


def test_greedy_with_oracle_drafts_equals_without(monkeypatch, checkpoint, reference):
    oracle_drafts(monkeypatch, reference, lambda i: i % 4 != 2, vocab=256)
    engine = _engine(checkpoint[0], nextn=2)
    assert _generate(engine) == reference
    stats = engine.spec.slots.stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens


def test_pe_reads_no_mtp_tensor(checkpoint):
    pe = _engine(checkpoint[0], nextn=2, role=EngineType.PROMPT)
    assert pe.worker.draft is None and pe.spec is None


def test_checkpoint_without_mtp_layer_is_refused(tmp_path):
    save_hf_checkpoint("deepseek_v3", tmp_path, seed=1)
    with pytest.raises(ValueError, match="MTP layer"):
        _engine(tmp_path, nextn=1)
    assert _engine(tmp_path, nextn=0).spec is None


def test_greedy_through_an_in_process_handoff_equals_without(checkpoint, reference):
    """PE -> CE by block copy (`copy_handoff`, the transfer plane's reference) plus the prompt's last
    hidden state, as the hand-off notice carries it: the CE drafts from its first decode step."""
    pe = _engine(checkpoint[0], nextn=2, role=EngineType.PROMPT)
    ce = _engine(checkpoint[0], nextn=2, role=EngineType.COMPLETION)
    for j, prompt in enumerate(PROMPTS):
        pe_seq = prefill_on(pe, f"r{j}", prompt, greedy(16))
        hidden = pe.worker.runner.last_hidden[-1]  # one prompt per PE step: its last row
        seq = copy_handoff(pe, pe_seq, ce, greedy(16))
        ce.spec.start_from_handoff(seq, hidden)
        assert len(ce.spec.slots.get(seq).tokens) == 2
    done = run_to_completion(ce)
    assert {rid: o.outputs[0].token_ids for rid, o in done.items()} == reference
    assert ce.scheduler.block_manager.num_free_blocks == ce.scheduler.block_manager.num_blocks
