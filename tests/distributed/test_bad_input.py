"""Expert-parallel settings that cannot work fail at start-up with a message that says why."""

import pytest

from deepinfer_core.config import EplbConfig, ParallelConfig
from deepinfer_core.distributed.placement import ExpertPlacement, check_expert_parallel
from deepinfer_core.engine.llm_engine import LLMEngine
from deepinfer_core.engine_args import EngineArgs
from tests.helpers.hf_models import tiny_hf_config


def _config(**kw):
    return EngineArgs(device="cpu", max_model_len=256, **kw).create_engine_config()


@pytest.mark.parametrize("ep", [3, 16])
def test_ep_not_dividing_or_exceeding_the_experts_is_refused(ep):
    # the built-in model has 8 routed experts
    with pytest.raises(ValueError, match=f"expert_parallel_size={ep} must divide the 8 routed experts"):
        _config(expert_parallel_size=ep, data_parallel_size=ep)


def test_redundant_slots_can_make_an_ep_size_fit():
    cfg = _config(expert_parallel_size=3, data_parallel_size=3, eplb=EplbConfig(num_redundant_experts=1))
    assert cfg.parallel.expert_parallel_size == 3
    assert ExpertPlacement.contiguous(2, 8, 3, 1).slots_per_rank == 3


def test_a_dense_model_with_ep_is_refused(tmp_path):
    tiny_hf_config("llama").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        _config(model=str(tmp_path), expert_parallel_size=2, data_parallel_size=2)


def test_ep_needs_as_many_dp_attention_ranks():
    with pytest.raises(ValueError, match="needs data_parallel_size equal to it"):
        ParallelConfig(expert_parallel_size=2, data_parallel_size=1)


def test_an_ep_engine_without_its_instance_group_is_refused():
    cfg = _config(expert_parallel_size=2, data_parallel_size=2, num_gpu_blocks=16)
    with pytest.raises(ValueError, match="needs the instance's group of 2 ranks"):
        LLMEngine(cfg)


def test_negative_redundancy_is_refused():
    with pytest.raises(ValueError, match="num_redundant_experts must be >= 0"):
        check_expert_parallel(8, 2, -1)
