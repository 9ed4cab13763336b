"""Conditional disaggregation in the CE: a prompt whose uncached part is short is prefilled by the
CE itself (in a prefill step of its own, within its decode bound) and decodes with the NORMAL
engine's greedy output; a long uncached part, n > 1 or a CE with local prefill off is refused
with a capacity error (the router then takes the P/D path), and nothing stays allocated."""

import os

import pytest
import torch

from deepinfer_core import envs
from deepinfer_core.config import PDConfig
from deepinfer_core.engine_args import EngineArgs
from deepinfer_core.errors import CapacityError, InvalidRequestError
from deepinfer_core.pd.completion_engine import CompletionEngine
from deepinfer_core.roles import EngineType, role_profile
from deepinfer_core.sampling_params import SamplingParams
from tests.helpers.pd import ENGINE_ARGS, greedy, normal_reference

LIMIT = 32


def _ce(limit: int = LIMIT) -> CompletionEngine:
    args = EngineArgs(
        engine_type=EngineType.COMPLETION,
        stop_preempted_request=True,
        pd=PDConfig(local_prefill_tokens=limit),
        **ENGINE_ARGS,
    )
    return CompletionEngine.from_engine_args(args)


@pytest.fixture(scope="module", autouse=True)
def _role_environment():
    """Building a CE here sets its role's environment defaults (`EngineArgs`); later modules of this
    process must see their own."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
    for name in ("DEEPINFER_ZERO_OVERHEAD_SCHEDULING", "DEEPINFER_USE_MULTIMODAL_POOL"):
        envs.rearm(name)


@pytest.fixture(scope="module")
def ce():
    return _ce()


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(ce, prompts: dict[str, list[int]], params: SamplingParams) -> dict[str, list[int]]:
    for rid, prompt in prompts.items():
        ce.add_local_prefill(rid, params, prompt)
    done = {}
    for _ in range(500):
        if not ce.has_unfinished_requests():
            break
        done.update({o.request_id: o.outputs[0].token_ids for o in ce.step() if o.finished})
    assert set(prompts) <= set(done), f"unfinished: {set(prompts) - set(done)}"
    return done


def test_the_role_table_names_the_ce_as_the_only_local_prefiller():
    assert role_profile(EngineType.COMPLETION).prefills_short_prompts
    assert not role_profile(EngineType.PROMPT).prefills_short_prompts
    assert not role_profile(EngineType.NORMAL).prefills_short_prompts


def test_short_prompts_prefilled_on_the_ce_equal_the_normal_engine(ce):
    prompts = {f"short-{i}": _tokens(5 + 9 * i, seed=i) for i in range(3)}
    free = ce.scheduler.block_manager.num_free_blocks
    got = _run(ce, prompts, greedy(12))
    want = normal_reference(list(prompts.values()), greedy(12))
    assert [got[r] for r in prompts] == want
    assert ce.load().local_prefills >= 3
    assert ce.scheduler.block_manager.num_free_blocks == free


def test_a_local_prefill_joins_while_others_decode(ce):
    first, second = _tokens(20, seed=10), _tokens(12, seed=11)
    ce.add_local_prefill("early", greedy(24), first)
    outs = {}
    for _ in range(4):  # "early" is decoding when "late" arrives
        outs.update({o.request_id: o.outputs[0].token_ids for o in ce.step() if o.finished})
    outs.update(_run(ce, {"late": second}, greedy(8)))
    for _ in range(200):
        if not ce.has_unfinished_requests():
            break
        outs.update({o.request_id: o.outputs[0].token_ids for o in ce.step() if o.finished})
    assert outs["early"] == normal_reference([first], greedy(24))[0]
    assert outs["late"] == normal_reference([second], greedy(8))[0]


def test_the_uncached_part_counts_past_the_ce_prefix_cache(ce):
    base = _tokens(24, seed=20)  # 3 full blocks of 8, cached on the CE once it ran
    _run(ce, {"base": base}, greedy(2))
    longer = base + _tokens(LIMIT - 8, seed=21)  # 48 tokens, 24 uncached
    hits = ce.load().prefix_hits
    got = _run(ce, {"longer": longer}, greedy(6))
    assert ce.load().prefix_hits - hits == 24
    assert got["longer"] == normal_reference([longer], greedy(6))[0]


def test_what_the_ce_will_not_prefill_is_refused_with_nothing_held(ce):
    free = ce.scheduler.block_manager.num_free_blocks
    with pytest.raises(CapacityError, match="uncached prompt tokens"):
        ce.add_local_prefill("long", greedy(4), _tokens(LIMIT + 9, seed=30))
    with pytest.raises(InvalidRequestError, match="n=1"):
        ce.add_local_prefill("many", SamplingParams(n=2, max_tokens=4), _tokens(8, seed=31))
    assert "long" not in ce.requests and "many" not in ce.requests
    assert ce.scheduler.block_manager.num_free_blocks == free
    assert not ce.scheduler.waiting


def test_local_prefill_off_refuses_every_prompt():
    ce = _ce(limit=0)
    with pytest.raises(CapacityError, match="local_prefill_tokens=0"):
        ce.add_local_prefill("off", greedy(4), _tokens(4, seed=40))
    assert not ce.requests
