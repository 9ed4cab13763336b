"""SPEC §1: every row of the role table, each checked on the real component it changes."""

import os

import pytest
import torch

from deepinfer_core import envs
from deepinfer_core.engine.llm_engine import LLMEngine
from deepinfer_core.engine_args import EngineArgs
from deepinfer_core.engine_type import EngineType
from deepinfer_core.role_profile import role_profile
from deepinfer_core.worker.model_runner import ModelRunner
from tests.helpers.engines import make_engine

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


def test_profile_table_rows_that_later_subsystems_read():
    # MoE workspace bound and EPLB counting are read by the MoE layer and the expert balancer.
    assert role_profile(EngineType.COMPLETION).moe_token_bound == "decode"
    assert role_profile(EngineType.PROMPT).moe_token_bound == "prefill"
    assert role_profile(EngineType.NORMAL).moe_token_bound == "prefill"
    assert not role_profile(EngineType.NORMAL).eplb_counts_prefill_steps
    assert role_profile(EngineType.PROMPT).eplb_counts_prefill_steps
    assert not role_profile(EngineType.PROMPT).speculative_slot_pool
    assert role_profile(EngineType.COMPLETION).speculative_slot_pool


def test_engine_name_is_role_and_device(caplog):
    caplog.set_level("INFO")
    e = make_engine(EngineType.PROMPT)
    assert e.name == "PROMPT_cpu"
    assert any("PROMPT_cpu" in r.message for r in caplog.records)
