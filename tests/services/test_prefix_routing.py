"""Prefix-aware prefill choice as plain units: the router's prefix index (chain hashes, bounded
LRU per worker) and the prefill policy's score (queued tokens + the prompt's tokens not held)."""

import argparse

import pytest

from services.cli.kv_store_args import add_arguments, config_from_args, default_store_dir, parse_bytes
from services.router.prefill_policy import PrefillCandidate, PrefillPolicy
from services.router.prefix_index import CHUNK_TOKENS, PrefixSet, capacity_for, chunk_hashes


def test_chunk_hashes_name_prefixes_not_chunks():
    a = list(range(100))
    b = list(range(40)) + [999] + list(range(41, 100))
    ha, hb = chunk_hashes(a), chunk_hashes(b)
    assert len(ha) == 100 // CHUNK_TOKENS
    assert ha[:2] == hb[:2] and all(x != y for x, y in zip(ha[2:], hb[2:]))  # chunk 2 differs, so do all after it
    swapped = a[16:32] + a[:16] + a[32:]
    assert chunk_hashes(swapped)[2] != ha[2]  # equal chunk, different prefix
    assert chunk_hashes(list(range(15))) == []


def test_prefix_set_matches_the_longest_remembered_prefix_and_forgets_the_oldest():
    s = PrefixSet(capacity=8)
    first = chunk_hashes(list(range(64)))  # 4 chunks
    s.record(first)
    assert s.matched_tokens(chunk_hashes(list(range(80)))) == 64
    assert s.matched_tokens(chunk_hashes([7] * 64)) == 0
    s.record(chunk_hashes([1] * 96))  # 6 more chunks: the first prompt's 2 oldest go
    assert len(s) == 8
    assert s.matched_tokens(first) == 0  # its first chunk is gone, so no prefix of it matches
    assert capacity_for(num_blocks=10, block_size=16) == 4096
    assert capacity_for(num_blocks=100_000, block_size=16) == 200_000


def test_prefill_policy_prefers_the_engine_holding_the_prefix_whatever_its_bucket():
    policy = PrefillPolicy((512, 2048))
    pes = [PrefillCandidate(f"pe-{i}", q) for i, q in enumerate([0, 0, 0, 0, 0, 0])]
    assert policy.pick(100, pes) == "pe-0"  # bucket 0: pe-0, pe-3
    pes[4].cached_tokens = 96  # pe-4 serves medium prompts but holds 96 of these 100 tokens
    assert policy.pick(100, pes) == "pe-4"
    pes[4].queued_tokens = 200  # busy enough that computing all 100 elsewhere is less work
    assert policy.pick(100, pes) == "pe-0"
    pes[3].cached_tokens = 32  # in the bucket, holds some: wins over pe-0
    assert policy.pick(100, pes) == "pe-3"
    tie = [PrefillCandidate("a", 10, cached_tokens=10), PrefillCandidate("b", 0)]
    assert policy.pick(100, tie) == "a"  # equal work (both in the one bucket): the lowest id
    assert PrefillCandidate("x", 5, cached_tokens=500).score(100) == 5  # never below its queue


def test_store_flags_default_on_under_the_cache_dir():
    p = argparse.ArgumentParser()
    add_arguments(p)
    on = config_from_args(p.parse_args([]))
    assert on.enabled and on.directory == default_store_dir() and on.l3_bytes == 2 * 2**30
    chosen = config_from_args(
        p.parse_args(["--kv-store-dir", "/tmp/s", "--kv-store-bytes", "3GiB", "--kv-host-bytes", "64MB"])
    )
    assert (chosen.directory, chosen.l3_bytes, chosen.l2_bytes) == ("/tmp/s", 3 * 2**30, 64 * 10**6)
    assert not config_from_args(p.parse_args(["--no-kv-store"])).enabled


def test_store_flags_put_the_store_in_a_bucket_and_refuse_mixed_places():
    p = argparse.ArgumentParser()
    add_arguments(p)
    argv = [
        "--kv-store-url",
        "s3://kv-cache/prod",
        "--kv-store-endpoint",
        "http://minio:9000",
        "--kv-store-region",
        "eu-1",
    ]
    chosen = config_from_args(p.parse_args([*argv, "--kv-store-bytes", "1TiB"]))
    assert (chosen.url, chosen.endpoint, chosen.region, chosen.directory) == (
        "s3://kv-cache/prod",
        "http://minio:9000",
        "eu-1",
        None,
    )
    assert chosen.enabled and chosen.l3_bytes == 2**40 and chosen.location == "s3://kv-cache/prod"
    refused = {
        "two places": ["--kv-store-url", "s3://kv-cache", "--kv-store-dir", "/tmp/s"],
        "need --kv-store-url": ["--kv-store-endpoint", "http://minio:9000"],
        "only s3://": ["--kv-store-url", "gs://kv-cache"],
        "not an S3 bucket name": ["--kv-store-url", "s3://Bad_Name"],
        "give a URL": ["--kv-store-url", "s3://kv-cache", "--kv-store-endpoint", "minio:9000"],
    }
    for message, bad in refused.items():
        with pytest.raises(ValueError, match=message):
            config_from_args(p.parse_args(bad))


@pytest.mark.parametrize(
    "text,value", [("1024", 1024), ("4GiB", 4 * 2**30), ("1.5k", 1500), ("2 mib", 2 * 2**20), ("1e9", 10**9)]
)
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "lots", "-5", "0", "4XB"])
def test_parse_bytes_refuses_what_is_not_a_size(text):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bytes(text)
