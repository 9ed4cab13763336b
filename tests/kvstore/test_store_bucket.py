"""`KVStore` with L3 in an S3-compatible bucket (moto's server on 127.0.0.1, NIXL's real OBJ plugin):
saves become objects, a fresh store (here, or in another process) loads them back, damage is caught
and deleted, the byte limit holds with the least recently used going first, and a bucket that cannot
be reached fails the store's start with its cause."""

import subprocess
import sys
import textwrap
import time

import pytest
import torch

from tests.helpers.s3 import require_obj_plugin

require_obj_plugin()

from deepinfer_core.kvstore import object_tier  # noqa: E402
from deepinfer_core.kvstore.bucket import StoreUnreachable  # noqa: E402
from deepinfer_core.kvstore.file_tier import LoadJob  # noqa: E402
from deepinfer_core.kvstore.store import L2, L3  # noqa: E402
from tests.helpers.kv_store import bucket_store_config, cpu_store, load_stored, settle  # noqa: E402
from tests.helpers.s3 import make_bucket, objects, s3_server  # noqa: E402

KEYS = [bytes([i]) * 16 for i in range(6)]
_buckets = iter(range(10**6))


@pytest.fixture(scope="module")
def endpoint():
    with s3_server() as url:
        yield url


@pytest.fixture
def bucket(endpoint):
    """A fresh bucket: (its name, a boto3 client)."""
    name = f"kv-{next(_buckets)}"
    return name, make_bucket(endpoint, name)


def _store(endpoint, bucket, prefix="engines/", **kw):
    return cpu_store(None, config=bucket_store_config(f"s3://{bucket[0]}/{prefix}", endpoint, **kw))


def _saved(endpoint, bucket, **kw):
    writer = _store(endpoint, bucket, **kw)
    writer.save(KEYS, [1, 2, 3, 4, 5, 6])
    settle(writer)
    return writer


def test_a_fresh_store_loads_the_saved_blocks_from_objects(endpoint, bucket):
    writer = _saved(endpoint, bucket)
    assert writer.tier.io.name == "OBJ"
    stored = objects(bucket[1], bucket[0])
    frame_bytes = writer.pool.frame_bytes
    assert stored == {f"engines/{k.hex()}.kvblock": frame_bytes for k in KEYS}
    assert writer.stats().saved_blocks == 6 and writer.stats().l3_bytes == 6 * frame_bytes
    reader = _store(endpoint, bucket)
    tiers, placed = load_stored(reader, KEYS, [10, 11, 12, 13, 14, 15])
    assert tiers == [L3] * 6 and placed == 6
    assert torch.equal(reader.kv[:, 10:16], writer.kv[:, 1:7])
    assert reader.lookup(KEYS) == [L2] * 6  # promoted
    stats = reader.stats()
    assert stats.hit_tokens_l3 == 48 and stats.load_bytes_l3 == 6 * frame_bytes
    assert stats.l2_pins == 0 and stats.inflight_loads == 0
    # a save of what the bucket holds writes nothing, even from a store that did not write it
    reader.save(KEYS, [10, 11, 12, 13, 14, 15])
    settle(reader)
    assert reader.stats().saved_blocks == 0 and reader.stats().save_skipped_blocks == 6


def test_prefixes_keep_stores_apart_and_a_lookup_ends_at_the_first_gap(endpoint, bucket):
    _saved(endpoint, bucket)
    assert _store(endpoint, bucket, prefix="other").lookup(KEYS) == []
    bucket[1].delete_object(Bucket=bucket[0], Key=f"engines/{KEYS[2].hex()}.kvblock")
    assert _store(endpoint, bucket).lookup(KEYS) == [L3, L3]


def test_a_long_prompt_is_looked_up_in_growing_runs_to_its_first_gap(endpoint, bucket):
    long = [i.to_bytes(2, "little") * 8 for i in range(70)]  # runs of 32 then 64 keys: the gap is in the second
    writer = _store(endpoint, bucket, prefix="long/")
    writer.save(long, [i % 32 for i in range(70)])
    settle(writer)
    unknown = [bytes([0xEE, i]) * 8 for i in range(10)]
    assert _store(endpoint, bucket, prefix="long/").lookup(long + unknown) == [L3] * 70


def test_another_process_hits_what_this_one_wrote(endpoint, bucket, tmp_path):
    writer = _saved(endpoint, bucket)
    script = textwrap.dedent(
        f"""
        import torch
        from tests.helpers.kv_store import bucket_store_config, cpu_store
        store = cpu_store(None, config=bucket_store_config("s3://{bucket[0]}/engines/", "{endpoint}"))
        keys = [bytes([i]) * 16 for i in range(6)]
        tiers = store.lookup(keys)
        load = store.start_load(keys, tiers)
        while not load.done:
            store.poll(wait_s=0.01)
        store.kv.zero_()
        placed = store.finish_load(load, list(range(20, 26)))
        torch.save(store.kv[:, 20:26].clone(), "{{out}}")
        print(tiers.count("l3"), placed, store.tier.io.name)
        """
    )
    out = str(tmp_path / "loaded.pt")
    done = subprocess.run(
        [sys.executable, "-c", script.replace("{out}", out)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-1].split() == ["6", "6", "OBJ"]  # NIXL logs on stdout before
    assert torch.equal(torch.load(out), writer.kv[:, 1:7])


def _flip(client, bucket: str, key: str, offset: int) -> None:
    body = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[offset] ^= 0xFF
    client.put_object(Bucket=bucket, Key=key, Body=bytes(body))


@pytest.mark.parametrize("damage", ["flipped", "truncated", "header"])
def test_a_damaged_object_ends_the_load_there_and_is_deleted(endpoint, bucket, damage):
    writer = _saved(endpoint, bucket)
    name, client = bucket
    key = f"engines/{KEYS[3].hex()}.kvblock"
    if damage == "flipped":
        _flip(client, name, key, writer.pool.frame_bytes - 5)
    elif damage == "header":
        _flip(client, name, key, 100)
    else:
        body = client.get_object(Bucket=name, Key=key)["Body"].read()
        client.put_object(Bucket=name, Key=key, Body=body[: len(body) // 2])
    reader = _store(endpoint, bucket)
    reader.kv.zero_()
    _, placed = load_stored(reader, KEYS, [10, 11, 12, 13, 14, 15])
    assert placed == 3 and torch.equal(reader.kv[:, 10:13], writer.kv[:, 1:4])
    assert not reader.kv[:, 13:16].any()  # nothing of the damaged entry or past it was placed
    assert reader.stats().corrupt_entries == 1 and key not in objects(client, name)
    assert reader.lookup(KEYS) == [L2] * 3


def test_an_object_gone_since_the_lookup_is_a_failed_load(endpoint, bucket):
    _saved(endpoint, bucket)
    reader = _store(endpoint, bucket)
    tiers = reader.lookup(KEYS)
    bucket[1].delete_object(Bucket=bucket[0], Key=f"engines/{KEYS[1].hex()}.kvblock")
    load = reader.start_load(KEYS, tiers)
    while not load.done:
        reader.poll(wait_s=0.01)
    assert reader.finish_load(load, list(range(10, 16))) == 1
    assert reader.stats().load_failures == 1 and reader.stats().l2_pins == 0


def test_the_bucket_never_holds_more_than_its_limit_and_hits_stay_longest(endpoint, bucket):
    frame_bytes = _store(endpoint, bucket, prefix="probe/").pool.frame_bytes
    limit = 3 * frame_bytes + frame_bytes // 2  # room for 3 entries
    store = _store(endpoint, bucket, l3_bytes=limit)
    held = bytes([9]) * 16
    store.save([held], [0])
    settle(store)
    for round_ in range(4):
        store.save([bytes([round_, i]) * 8 for i in range(2)], [round_ + 1, round_ + 2])
        settle(store)
        _read_from_bucket(store, held)  # a hit: the most recently used entry now
        in_bucket = objects(bucket[1], bucket[0])
        assert sum(in_bucket.values()) <= limit
    stats = store.stats()
    assert f"engines/{held.hex()}.kvblock" in in_bucket and len(in_bucket) == 3
    assert stats.evictions_l3 == 6 and stats.l3_bytes == 3 * frame_bytes and stats.saved_blocks == 9


def test_two_stores_keep_one_limit_through_the_listing(endpoint, bucket, monkeypatch):
    frame_bytes = _store(endpoint, bucket, prefix="probe/").pool.frame_bytes
    limit = 3 * frame_bytes + frame_bytes // 2
    late = _store(endpoint, bucket, l3_bytes=limit)  # listed the bucket empty
    early = _store(endpoint, bucket, l3_bytes=limit)
    early.save(KEYS[:2], [1, 2])
    settle(early)
    time.sleep(1.1)  # the listing's write times have whole seconds (moto): KEYS[2] is newer, not a tie
    early.save(KEYS[2:3], [3])
    settle(early)
    monkeypatch.setattr(object_tier, "RELIST_S", 0.0)  # the late store's next save lists again
    late.save(KEYS[3:5], [4, 5])
    settle(late)
    in_bucket = objects(bucket[1], bucket[0])
    assert sum(in_bucket.values()) <= limit and late.stats().evictions_l3 == 2
    assert sorted(in_bucket) == sorted(f"engines/{k.hex()}.kvblock" for k in [KEYS[2], KEYS[3], KEYS[4]])


def _read_from_bucket(store, key: bytes) -> None:
    slots = store.pool.stage(1)
    result = store.tier.load(LoadJob([key], slots))
    store.pool.unpin(slots)
    assert result.ok == 1


def test_a_bucket_that_cannot_be_used_fails_the_start_with_its_cause(endpoint):
    with pytest.raises(StoreUnreachable, match="no such bucket"):
        cpu_store(None, config=bucket_store_config("s3://never-made", endpoint))
    with pytest.raises(StoreUnreachable, match="s3://never-made"):
        cpu_store(None, config=bucket_store_config("s3://never-made", "http://127.0.0.1:9"))


def test_a_bucket_gone_quiet_costs_misses_not_a_wait_per_prompt():
    with s3_server() as short_lived:
        name = "kv-quiet"
        store = _store(short_lived, (name, make_bucket(short_lived, name)))
    others = [bytes([7, i]) * 8 for i in range(4)]
    for _ in range(3):  # the server is gone: the first lookup waits out its deadline, the rest not at all
        start = time.monotonic()
        assert store.lookup(others) == []
        assert time.monotonic() - start < object_tier.LOOKUP_TIMEOUT_S + 0.5


def test_serve_stops_before_starting_anything_when_the_bucket_cannot_be_used(endpoint, bucket, capsys):
    from services.cli.main import main

    argv = ["serve", "--gpus-per-worker", "0", "--kv-store-endpoint", endpoint, "--kv-store-url"]
    assert main([*argv, "s3://never-made/kv"]) == 2
    assert "KV store s3://never-made/kv/: no such bucket" in capsys.readouterr().err
    from deepinfer_core.kvstore.object_tier import check_bucket

    check_bucket(bucket_store_config(f"s3://{bucket[0]}/kv", endpoint))  # a bucket that answers: no error
