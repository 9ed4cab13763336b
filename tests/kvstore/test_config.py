"""The store is off unless configured, and its settings are checked when the config is built."""

import pytest

from deepinfer_core.config import KVStoreConfig, bucket_of
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


@pytest.mark.parametrize(
    "bad,message",
    [
        (dict(directory="/tmp/x", url="s3://kv-cache"), "not both"),
        (dict(url="s3://kv-cache", endpoint="minio:9000"), "give a URL"),
        (dict(url="file:///tmp/x"), "only s3://"),
        (dict(directory="/tmp/x", region="eu-west-1"), "needs a bucket URL"),
    ],
    ids=str,
)
def test_bad_bucket_settings_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        KVStoreConfig(**bad)


def test_a_bucket_store_is_on_with_its_prefix():
    config = KVStoreConfig(url="s3://kv-cache/team/a/", endpoint="https://s3.example:443", region="eu-west-1")
    assert config.enabled and config.location == "s3://kv-cache/team/a/"
    assert bucket_of(config.url) == ("kv-cache", "team/a/") and bucket_of("s3://kv-cache") == ("kv-cache", "")


def test_a_pool_too_small_for_one_block_fails_at_start(tmp_path):
    with pytest.raises(ValueError, match="l2_bytes"):
        local_pe(kv_store=KVStoreConfig(directory=str(tmp_path), l2_bytes=1000))
