"""SPEC §1: every row of the role table, each checked on the real component it changes.

Rows checked elsewhere: the scheduler branch, the empty prefill schedule, chunked prefill and
`add_sequence`'s reservation in test_scheduler.py (the DP vote in test_dp_vote.py); `finalize_seq`
in test_invariants.py (invariant 5) and test_hook_order.py, which also checks that only a PE's
step hands prompts off (`send_processed_prompts`) and that a PE never overlaps its steps.
"""

import os

import pytest
import torch

from deepinfer_core import envs
from deepinfer_core.engine.llm_engine import LLMEngine
from deepinfer_core.engine_args import EngineArgs
from deepinfer_core.pd.completion_engine import CompletionEngine
from deepinfer_core.pd.prompt_engine import PromptEngine
from deepinfer_core.roles import EngineType, engine_class, role_profile
from deepinfer_core.worker.model_runner import ModelRunner
from tests.helpers.engines import make_engine
from tests.helpers.sched import complete_step, handed_off, make_scheduler, make_seq

ROLES = list(EngineType)


def test_enum_values_are_the_wire_contract():  # invariant 1 (the proto side is tested with the proto)
    assert [(t.name, t.value) for t in EngineType] == [("NORMAL", 0), ("PROMPT", 1), ("COMPLETION", 2)]
    assert EngineType(1) is EngineType.PROMPT


def test_default_zero_overhead_scheduling():
    assert EngineType.NORMAL.default_zero_overhead_scheduling
    assert not EngineType.PROMPT.default_zero_overhead_scheduling
    assert EngineType.COMPLETION.default_zero_overhead_scheduling


@pytest.fixture
def clean_env(monkeypatch):
    for name in ("DEEPINFER_ZERO_OVERHEAD_SCHEDULING", "DEEPINFER_USE_MULTIMODAL_POOL"):
        monkeypatch.delenv(name, raising=False)
    yield
    envs.rearm()


@pytest.mark.parametrize("role", ROLES)
def test_engine_args_apply_role_defaults_to_env_and_snapshot(clean_env, role):
    EngineArgs(engine_type=role)
    assert os.environ["DEEPINFER_ZERO_OVERHEAD_SCHEDULING"] == ("1" if role != EngineType.PROMPT else "0")
    assert envs.DEEPINFER_ZERO_OVERHEAD_SCHEDULING == (role != EngineType.PROMPT)
    assert envs.DEEPINFER_USE_MULTIMODAL_POOL == (role != EngineType.COMPLETION)
    assert envs.DEEPINFER_USE_MULTIMODAL_POOL == role_profile(role).multimodal_pool_default


def test_operator_env_wins_over_role_default(clean_env, monkeypatch):
    monkeypatch.setenv("DEEPINFER_ZERO_OVERHEAD_SCHEDULING", "1")
    EngineArgs(engine_type=EngineType.PROMPT)
    assert envs.DEEPINFER_ZERO_OVERHEAD_SCHEDULING is True


def test_profile_shapes_follow_the_role():
    for role in ROLES:
        config = EngineArgs(
            engine_type=role, max_model_len=128, max_num_seqs=4, stop_preempted_request=True
        ).create_engine_config()
        runner = ModelRunner(config, model=None, device=torch.device("cpu"))
        shapes = runner.profile_shapes()
        if role == EngineType.COMPLETION:
            assert shapes == [(1, 1)] * 4  # decode shapes: 1 + nextn tokens per sequence
        else:
            # prefill shapes: the token budget, as far as max_num_seqs prompts of max_model_len reach
            assert sum(n for n, _ in shapes) == min(config.scheduler.max_num_batched_tokens, 4 * 128)
            assert max(n for n, _ in shapes) == 128


def test_cuda_graphs_off_for_prompt_and_when_eager():
    for role in ROLES:
        for eager in (False, True):
            config = EngineArgs(
                engine_type=role, enforce_eager=eager, stop_preempted_request=True
            ).create_engine_config()
            runner = ModelRunner(config, model=None, device=torch.device("cuda"))
            assert runner.use_cuda_graph == (not eager and role != EngineType.PROMPT)
            assert not ModelRunner(config, model=None, device=torch.device("cpu")).use_cuda_graph


class _PDSplitCount(LLMEngine):
    pd_split_calls = 0

    def init_pd_split(self):
        type(self).pd_split_calls += 1


@pytest.mark.parametrize("role", ROLES)
def test_init_pd_split_only_for_prompt_and_completion(role):
    _PDSplitCount.pd_split_calls = 0
    make_engine(role, cls=_PDSplitCount)
    assert _PDSplitCount.pd_split_calls == (0 if role == EngineType.NORMAL else 1)


def test_context_parallel_forbidden_for_completion():  # invariant 4
    with pytest.raises(AssertionError, match="context parallel"):
        make_engine(EngineType.COMPLETION, context_parallel_size=2)
    assert make_engine(EngineType.PROMPT, context_parallel_size=2).engine_type == EngineType.PROMPT


def test_completion_without_stop_preempted_request_refuses_to_start():
    with pytest.raises(ValueError, match="stop_preempted_request"):
        make_engine(EngineType.COMPLETION, stop_preempted_request=False)


@pytest.mark.parametrize("role", ROLES)
def test_multimodal_processor_is_built_only_where_the_role_has_a_pool(clean_env, role):
    engine = make_engine(role)  # the embedded model takes images
    assert (engine.mm_processor is not None) == (role != EngineType.COMPLETION)


def test_forward_token_bound_follows_the_role():  # SPEC's MoE / workspace token bound
    for role in ROLES:
        sched = (
            EngineArgs(engine_type=role, max_model_len=128, max_num_seqs=4, stop_preempted_request=True)
            .create_engine_config()
            .scheduler
        )
        want = sched.max_num_decoding_tokens if role == EngineType.COMPLETION else sched.max_num_batched_tokens
        assert sched.max_step_tokens == want


@pytest.mark.parametrize("role", ROLES)
def test_draft_tokens_are_fed_only_by_roles_that_decode(monkeypatch, role):  # the MTP / speculative slots
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "1")
    envs.rearm("DEEPINFER_USE_NEXTN_DECODE")
    try:
        config = EngineArgs(engine_type=role, max_model_len=128, stop_preempted_request=True).create_engine_config()
    finally:
        monkeypatch.delenv("DEEPINFER_USE_NEXTN_DECODE")
        envs.rearm("DEEPINFER_USE_NEXTN_DECODE")
    assert config.scheduler.num_decode_tokens_per_seq == (1 if role == EngineType.PROMPT else 2)


def _balance_steps(role: EngineType, kinds: str) -> int:
    """Expert-balance steps counted over a run of step kinds ("p": prefill, "d": decode)."""
    s = make_scheduler(role)
    for kind in kinds:
        if kind == "p":
            s.add_sequence(make_seq(prompt_len=4, max_tokens=100))
        elif not s.running and not s.prompted:
            handed_off(s, max_tokens=100)
        out = s.schedule()
        assert out.prompt_run == (kind == "p" or role == EngineType.PROMPT)
        complete_step(s, out)
    return s.expert_balance_steps


def test_eplb_counts_every_step_except_a_normal_engines_prefill_and_the_step_after():
    assert _balance_steps(EngineType.NORMAL, "pdddpdd") == 3  # the first decode after each prefill is skipped
    assert _balance_steps(EngineType.PROMPT, "ppp") == 3
    assert _balance_steps(EngineType.COMPLETION, "ddd") == 3


@pytest.mark.parametrize("role", ROLES)
def test_only_a_normal_engine_votes_on_the_step_kind(role):
    engine = make_engine(role, data_parallel_size=2)
    assert (engine.scheduler.dp_vote is not None) == (role == EngineType.NORMAL)
    assert make_engine(role).scheduler.dp_vote is None  # no vote without data parallelism


def test_engine_class_per_role():
    assert engine_class(EngineType.NORMAL) is LLMEngine
    assert engine_class(EngineType.PROMPT) is PromptEngine
    assert engine_class(EngineType.COMPLETION) is CompletionEngine
    for role in ROLES:
        assert role_profile(role).engine_type is role


def test_engine_name_is_role_and_device(caplog):
    caplog.set_level("INFO")
    e = make_engine(EngineType.PROMPT)
    assert e.name == "PROMPT_cpu"
    assert any("PROMPT_cpu" in r.message for r in caplog.records)
