"""EngineArgs' derived defaults: the KV block size follows the model's cache and the device."""

import torch

from deepinfer_core.engine_args import EngineArgs, default_block_size
from tests.helpers.hf_models import save_hf_checkpoint


def test_mla_models_get_64_token_blocks_on_cuda_only():
    mla = {"kv_lora_rank": 512, "qk_rope_head_dim": 64}
    assert default_block_size(mla, "cuda") == 64
    assert default_block_size(mla, "cuda:1") == 64
    assert default_block_size(mla, "cpu") == 16
    assert default_block_size({"num_key_value_heads": 8}, "cuda") == 16


def test_engine_config_resolves_the_block_size(tmp_path, monkeypatch):
    ds, llama = tmp_path / "ds", tmp_path / "llama"
    save_hf_checkpoint("deepseek_v3", ds)
    save_hf_checkpoint("llama", llama)

    def block_size(**kw):
        return EngineArgs(max_model_len=256, **kw).create_engine_config().cache.block_size

    assert block_size(model=str(ds), device="cpu") == 16
    assert block_size(device="cpu") == 16  # the embedded model
    assert block_size(model=str(ds), device="cpu", block_size=32) == 32  # an explicit size wins
    # on CUDA (configs only: nothing is allocated)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert block_size(model=str(ds), device="cuda") == 64
    assert block_size(model=str(ds), device="cuda", block_size=16) == 16
    assert block_size(model=str(llama), device="cuda") == 16
