"""Sampler: greedy, filtering, distribution, penalties, seeds, min_tokens and logprobs.

Expected values come from independent references (plain-Python softmax, sorting
and penalty loops, or torch.log_softmax in float64), never from the sampler.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional

import pytest
import torch

from deepinfer_core.sampling.penalties import apply_penalties
from deepinfer_core.sampling.sampler import Sampler, compute_prompt_logprobs
from deepinfer_core.sampling.sampling_row import SamplingRow
from deepinfer_core.sampling_params import SamplingParams

SAMPLER = Sampler()
NUM_DRAWS = 20_000


def make_row(
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
    seed: Optional[int] = None,
    eos: Optional[int] = None,
    **params,
) -> SamplingRow:
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    return SamplingRow(SamplingParams(seed=seed, **params), list(prompt), list(output), generator, eos_token_id=eos)


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    return SAMPLER(logits, rows).token_ids


def reference_probs(logits: list[float], temperature: float, top_k: int = 0, top_p: float = 1.0) -> list[float]:
    """softmax(logits / T), restricted to the top-k, then to the nucleus, renormalised each time."""
    weights = [math.exp(x / temperature) for x in logits]
    order = sorted(range(len(logits)), key=lambda i: -logits[i])
    keep = order[:top_k] if top_k else order
    total = sum(weights[i] for i in keep)
    nucleus, mass = [], 0.0
    for i in keep:
        nucleus.append(i)
        mass += weights[i] / total
        if mass >= top_p:
            break
    total = sum(weights[i] for i in nucleus)
    return [weights[i] / total if i in nucleus else 0.0 for i in range(len(logits))]


def empirical(tokens: list[int], vocab: int) -> list[float]:
    counts = torch.bincount(torch.tensor(tokens), minlength=vocab)
    return (counts.double() / len(tokens)).tolist()


@pytest.fixture(autouse=True)
def _seed_global_rng() -> None:
    torch.manual_seed(0)


# --- greedy and deterministic filters ---------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(dtype: torch.dtype) -> None:
    logits = torch.randn(16, 300).to(dtype)
    tokens = sample(logits, [make_row(temperature=0.0) for _ in range(16)])
    assert tokens == logits.float().argmax(dim=-1).tolist()


def test_tiny_temperature_is_greedy() -> None:
    logits = torch.randn(32, 100)
    assert sample(logits, [make_row(temperature=1e-6) for _ in range(32)]) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("params", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}], ids=str)
def test_filters_that_leave_one_token_are_greedy(params: dict) -> None:
    logits = torch.randn(200, 64) * 3
    tokens = sample(logits, [make_row(temperature=1.5, **params) for _ in range(200)])
    assert tokens == logits.argmax(-1).tolist()


def test_min_p_keeps_only_tokens_above_threshold() -> None:
    # p_i / p_max = exp(logit_i): 1, 0.37, 0.14, 0.05 -> min_p=0.3 keeps tokens 0 and 1
    logits = [0.0, -1.0, -2.0, -3.0]
    tokens = sample(torch.tensor([logits] * NUM_DRAWS), [make_row(min_p=0.3)] * NUM_DRAWS)
    freq = empirical(tokens, 4)
    expected_0 = 1 / (1 + math.exp(-1))
    assert freq[2] == 0 and freq[3] == 0
    assert abs(freq[0] - expected_0) < 0.015


# --- distribution -------------------------------------------------------------------------

LOGITS = [2.0, 1.5, 1.0, 0.3, -0.5, -1.0, 0.8, 1.2]


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 3, 1.0), (1.0, 0, 0.7), (0.8, 5, 0.8)],
)
def test_empirical_distribution_matches_reference(temperature: float, top_k: int, top_p: float) -> None:
    logits = torch.tensor([LOGITS] * NUM_DRAWS)
    rows = [make_row(temperature=temperature, top_k=top_k, top_p=top_p)] * NUM_DRAWS
    freq = empirical(sample(logits, rows), len(LOGITS))
    expected = reference_probs(LOGITS, temperature, top_k, top_p)
    for token, (f, p) in enumerate(zip(freq, expected, strict=True)):
        assert abs(f - p) < 0.015, f"token {token}: empirical {f:.4f} vs expected {p:.4f}"
        if p == 0.0:
            assert f == 0.0


def test_mixed_batch_greedy_rows_and_sampled_rows() -> None:
    logits = torch.tensor([LOGITS] * NUM_DRAWS)
    rows = [make_row(temperature=0.0 if i % 2 else 1.0, top_k=4) for i in range(NUM_DRAWS)]
    tokens = sample(logits, rows)
    assert set(tokens[1::2]) == {0}
    freq = empirical(tokens[0::2], len(LOGITS))
    for f, p in zip(freq, reference_probs(LOGITS, 1.0, top_k=4), strict=True):
        assert abs(f - p) < 0.02


# --- penalties ----------------------------------------------------------------------------


def reference_penalties(
    logits: list[float], prompt: list[int], output: list[int], rep: float, pres: float, freq: float
):
    out = list(logits)
    for t in set(prompt) | set(output):
        out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    for t in set(output):
        out[t] -= freq * output.count(t) + pres
    return out


def test_penalties_match_reference() -> None:
    cases = [
        ([1, 2, 2], [2, 3, 3, 5], 1.3, 0.5, 0.25),
        ([0, 7], [], 0.8, 1.0, 1.0),
        ([], [4, 4, 4, 6], 1.0, -0.5, 0.3),
        ([3], [1], 1.0, 0.0, 0.0),
    ]
    logits = torch.randn(len(cases), 8) * 2
    logits[:, 2] = -1.5  # a negative logit among the penalised tokens
    rows = [
        make_row(prompt=p, output=o, repetition_penalty=r, presence_penalty=a, frequency_penalty=f)
        for p, o, r, a, f in cases
    ]
    penalised = logits.clone()
    apply_penalties(penalised, rows)
    for i, case in enumerate(cases):
        expected = reference_penalties(logits[i].tolist(), *case)
        assert penalised[i].tolist() == pytest.approx(expected, rel=1e-6, abs=1e-6)


def test_frequency_penalty_changes_greedy_choice_from_output_only() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.5, 0.0]])
    # token 1 appears twice in the output: 3.0 - 2 * 0.5 = 2.0 < 2.5
    assert sample(logits, [make_row(output=[1, 1], temperature=0.0, frequency_penalty=0.5)]) == [2]
    # in the prompt only, presence/frequency penalties do not apply
    assert sample(logits, [make_row(prompt=[1, 1], temperature=0.0, frequency_penalty=0.5)]) == [1]
    # the repetition penalty does apply to prompt tokens: 3.0 / 1.5 = 2.0 < 2.5
    assert sample(logits, [make_row(prompt=[1], temperature=0.0, repetition_penalty=1.5)]) == [2]


# --- seeds --------------------------------------------------------------------------------


def _seeded_tokens(
    logits: torch.Tensor, seed: int, position: int, neighbours: list[dict], steps: int = 12
) -> list[int]:
    """Tokens of one seeded request over `steps` steps, at `position` among other rows."""
    target = make_row(seed=seed, temperature=1.0)
    tokens = []
    for _ in range(steps):
        rows = [make_row(**kw) for kw in neighbours]
        rows.insert(position, target)
        tokens.append(sample(logits.expand(len(rows), -1).contiguous(), rows)[position])
    return tokens


def test_same_seed_same_tokens_regardless_of_batch() -> None:
    logits = torch.randn(1, 500) * 0.5
    alone = _seeded_tokens(logits, seed=1234, position=0, neighbours=[])
    torch.manual_seed(99)  # the global RNG must not matter
    crowded = _seeded_tokens(
        logits,
        seed=1234,
        position=3,
        neighbours=[{"seed": 7}, {"temperature": 0.0}, {}, {"top_p": 0.5}, {"seed": 8, "top_k": 10}],
    )
    assert alone == crowded
    assert len(set(alone)) > 1  # the draws really are random


def test_different_seeds_differ() -> None:
    logits = torch.randn(1, 500) * 0.5
    assert _seeded_tokens(logits, 1, 0, []) != _seeded_tokens(logits, 2, 0, [])


def test_unseeded_rows_follow_global_rng() -> None:
    logits = torch.randn(64, 500) * 0.5
    rows = [make_row() for _ in range(64)]
    torch.manual_seed(5)
    first = sample(logits, rows)
    torch.manual_seed(5)
    assert sample(logits, rows) == first
    assert sample(logits, rows) != first


# --- min_tokens ---------------------------------------------------------------------------


def test_min_tokens_bans_eos_and_stop_ids() -> None:
    logits = torch.tensor([[5.0, 0.0, 1.0, 0.0, 0.0, 4.0]])  # EOS=0 first, stop id 5 second, then 2
    params = {"min_tokens": 3, "stop_token_ids": [5], "temperature": 0.0}
    assert sample(logits, [make_row(output=[1], eos=0, **params)]) == [2]
    assert sample(logits, [make_row(output=[1, 1, 1], eos=0, **params)]) == [0]
    assert sample(logits, [make_row(output=[1], eos=0, ignore_eos=True, **params)]) == [0]
    assert sample(logits, [make_row(output=[1], eos=None, **params)]) == [0]


def test_min_tokens_ban_holds_when_sampling() -> None:
    logits = torch.zeros(2000, 6)
    logits[:, 0] = logits[:, 5] = 3.0
    rows = [make_row(output=[], eos=0, min_tokens=1, stop_token_ids=[5]) for _ in range(2000)]
    assert not {0, 5} & set(sample(logits, rows))


# --- logprobs -----------------------------------------------------------------------------


def test_sampled_logprob_is_raw_log_softmax() -> None:
    logits = torch.randn(40, 300, dtype=torch.float64).float()
    rows = [
        make_row(output=[1, 2, 3], logprobs=0, temperature=0.6, top_k=20, repetition_penalty=1.4, presence_penalty=1.0)
        for _ in range(40)
    ]
    out = SAMPLER(logits, rows)
    raw = torch.log_softmax(logits.double(), dim=-1)
    for i, token in enumerate(out.token_ids):
        assert out.logprobs[i] == pytest.approx(raw[i, token].item(), abs=1e-5)
        assert out.top_logprobs[i] == pytest.approx({token: raw[i, token].item()}, abs=1e-5)


def test_top_logprobs_are_true_top_k_plus_sampled() -> None:
    logits = torch.randn(30, 200)
    rows = [make_row(logprobs=5) if i % 3 else make_row() for i in range(30)]
    out = SAMPLER(logits, rows)
    for i, (row, token) in enumerate(zip(rows, out.token_ids, strict=True)):
        if row.params.logprobs is None:
            assert out.top_logprobs[i] is None
            continue
        values = logits[i].tolist()
        top5 = sorted(range(200), key=lambda t: -values[t])[:5]
        assert set(out.top_logprobs[i]) == set(top5) | {token}
        lse = math.log(sum(math.exp(v) for v in values))
        for t, lp in out.top_logprobs[i].items():
            assert lp == pytest.approx(values[t] - lse, abs=1e-5)


def test_no_logprobs_when_no_row_asks() -> None:
    out = SAMPLER(torch.randn(4, 10), [make_row() for _ in range(4)])
    assert out.logprobs is None and out.top_logprobs is None


def test_prompt_logprobs_match_direct_computation() -> None:
    prompt = [3, 17, 17, 0, 42, 8]
    logits = torch.randn(len(prompt), 50)
    result = compute_prompt_logprobs(logits, prompt, num_top=3)
    assert len(result) == len(prompt) and result[0] is None
    ref = torch.log_softmax(logits.double(), dim=-1)
    for i in range(1, len(prompt)):
        top3 = ref[i - 1].topk(3).indices.tolist()
        assert set(result[i]) == set(top3) | {prompt[i]}
        for t, lp in result[i].items():
            assert lp == pytest.approx(ref[i - 1, t].item(), abs=1e-5)
    # the last row (next-token logits) is optional; too few rows is an error
    only_prompt_tokens = compute_prompt_logprobs(logits[:-1], prompt, 0)
    assert only_prompt_tokens[0] is None
    for i in range(1, len(prompt)):
        assert only_prompt_tokens[i] == pytest.approx({prompt[i]: ref[i - 1, prompt[i]].item()}, abs=1e-5)
    with pytest.raises(ValueError):
        compute_prompt_logprobs(logits[:-2], prompt, 0)
    assert compute_prompt_logprobs(logits[:1], prompt[:1], 2) == [None]


# --- contract -----------------------------------------------------------------------------


def test_caller_logits_are_not_modified() -> None:
    logits = torch.randn(6, 40)
    before = logits.clone()
    rows = [
        make_row(
            output=[1, 2],
            temperature=0.5,
            top_k=5,
            top_p=0.6,
            min_p=0.1,
            repetition_penalty=1.2,
            frequency_penalty=0.5,
            min_tokens=4,
            eos=3,
            logprobs=2,
        )
        for _ in range(6)
    ]
    SAMPLER(logits, rows)
    assert torch.equal(logits, before)


def test_shape_mismatch_raises() -> None:
    with pytest.raises(ValueError):
        SAMPLER(torch.randn(3, 10), [make_row()] * 2)


def test_large_mixed_batch_of_every_feature() -> None:
    batch, vocab = 64, 32_000
    logits = torch.randn(batch, vocab)
    rows = [
        make_row(
            prompt=range(i, i + 500),
            output=range(50),
            seed=i if i % 4 == 0 else None,
            eos=2,
            temperature=0.0 if i % 5 == 0 else 0.8,
            top_k=50 if i % 2 else 0,
            top_p=0.9 if i % 3 else 1.0,
            min_p=0.05 if i % 7 == 0 else 0.0,
            repetition_penalty=1.1,
            frequency_penalty=0.2,
            min_tokens=60,
            max_tokens=100,
            logprobs=5 if i % 2 else None,
        )
        for i in range(batch)
    ]
    out = SAMPLER(logits, rows)
    assert len(out.token_ids) == batch and all(0 <= t < vocab for t in out.token_ids)
    assert 2 not in out.token_ids  # EOS is banned by min_tokens
