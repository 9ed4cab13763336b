"""Speculative sampling preserves the target distribution (temperature > 0), checked by chi-square
tests on tiny vocabularies at fixed seeds: the acceptance rule alone, and the engine end to end
against a non-speculative engine."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.spec_decode.verify import accept_sampled
from tests.helpers.engines import make_engine, run_to_completion
from tests.helpers.spec import role_environment


def _critical(df: int, z: float = 3.09) -> float:
    """Chi-square critical value at p = 0.001 (z = 3.09), Wilson-Hilferty (within 2% from df = 3 on)."""
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


@pytest.fixture(scope="module", autouse=True)
def _env():
    with role_environment():
        yield


def _goodness_of_fit(counts: Counter, probs: torch.Tensor, n: int) -> float:
    expected = probs * n
    return float(sum((counts.get(t, 0) - e) ** 2 / e for t, e in enumerate(expected.tolist()) if e > 0))


def test_acceptance_rule_emits_target_distribution():
    torch.manual_seed(0)
    vocab, trials = 4, 6000
    p = torch.tensor([[0.5, 0.2, 0.2, 0.1], [0.1, 0.1, 0.3, 0.5], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.1, 0.6, 0.1, 0.2], [0.4, 0.4, 0.1, 0.1]])
    first, second = Counter(), Counter()
    for _ in range(trials):
        drafts = [int(torch.multinomial(q[j], 1)) for j in range(2)]
        out = accept_sampled(p, q, drafts)
        first[out[0]] += 1
        if len(out) > 1:  # the first draft was accepted: the second token is p[1]'s
            second[out[1]] += 1
    assert _goodness_of_fit(first, p[0], trials) < _critical(vocab - 1)
    assert _goodness_of_fit(second, p[1], sum(second.values())) < _critical(vocab - 1)


def _tokens(nextn: int, n: int = 240) -> list[list[int]]:
    torch.manual_seed(1234 + nextn)
    engine = make_engine(num_speculative_tokens=nextn, max_num_seqs=128)
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=6, ignore_eos=True)
    for j in range(n):
        engine.add_request(f"s{j}", params=params, prompt_token_ids=[11, 402, 77, 9])
    tokens = [o.outputs[0].token_ids for o in run_to_completion(engine).values()]
    if nextn:
        stats = engine.spec.slots.stats
        assert 0 < stats.accepted_tokens < stats.draft_tokens  # both branches of the rule ran
    return tokens


def _two_sample(a: Counter, b: Counter) -> tuple[float, int]:
    """Chi-square statistic of two equal-size samples over cells pooled to at least 10 counts each."""
    cells, pooled = [], [0, 0]
    for t in set(a) | set(b):
        if a[t] + b[t] >= 10:
            cells.append((a[t], b[t]))
        else:
            pooled = [pooled[0] + a[t], pooled[1] + b[t]]
    if sum(pooled) > 0:
        cells.append(tuple(pooled))
    return sum((x - y) ** 2 / (x + y) for x, y in cells), len(cells) - 1


def test_engine_sampling_matches_non_speculative():
    plain, spec = _tokens(0), _tokens(2)
    for position in (1, 2):  # the tokens a speculative step verifies (position 0 is the prefill's)
        stat, df = _two_sample(Counter(t[position] for t in plain), Counter(t[position] for t in spec))
        assert df >= 3 and stat < _critical(df), (position, stat, df)
