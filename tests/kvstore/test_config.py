"""The store is off unless configured, and its settings are checked when the config is built."""

import pytest

from deepinfer_core.config import KVStoreConfig
from deepinfer_core.engine_args import EngineArgs
from tests.helpers.pd import local_pe


def test_off_by_default():
    config = EngineArgs(device="cpu").create_engine_config()
    assert not config.kv_store.enabled
    pe = local_pe()
    assert pe.kv_store is None and pe.scheduler.kv_loader is None and pe.kv_store_stats() is None
    assert pe.load().kv_store_hit_tokens_l3 == 0


def test_engine_args_carry_the_store(tmp_path):
    store = KVStoreConfig(directory=str(tmp_path), l2_bytes=1 << 20)
    assert EngineArgs(device="cpu", kv_store=store).create_engine_config().kv_store == store


@pytest.mark.parametrize(
    "bad",
    [
        dict(backend="S3"),
        dict(l2_bytes=0),
        dict(l3_bytes=0),
        dict(save_every_blocks=-1),
        dict(load_timeout_s=0),
        dict(join_wait_s=-1),
    ],
    ids=str,
)
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError):
        KVStoreConfig(directory="/tmp/x", **bad)


def test_a_pool_too_small_for_one_block_fails_at_start(tmp_path):
    with pytest.raises(ValueError, match="l2_bytes"):
        local_pe(kv_store=KVStoreConfig(directory=str(tmp_path), l2_bytes=1000))
