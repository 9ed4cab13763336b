"""The KV store in an S3-compatible bucket between real processes (moto's server, NIXL's OBJ plugin):
a CE saves what a PE computed as objects, a fresh PE loads them and computes only the rest with the
NORMAL engine's greedy output; a damaged object is counted and recomputed, output identical."""

import pytest
import torch

from tests.helpers.s3 import require_obj_plugin

require_obj_plugin()

from deepinfer_core.roles import EngineType  # noqa: E402
from tests.helpers.kv_store import bucket_store_config, connect, start_engine, submit, wait_store_idle  # noqa: E402
from tests.helpers.pd import greedy, normal_reference, wait_ce  # noqa: E402
from tests.helpers.s3 import make_bucket, objects, s3_server  # noqa: E402

BS = 8


@pytest.fixture(scope="module")
def cluster():
    """One CE saving to the bucket, a writer PE without a store, a reader PE loading from the bucket."""
    with s3_server() as endpoint:
        client = make_bucket(endpoint, "kv-engines")
        store = bucket_store_config("s3://kv-engines/cluster", endpoint)
        ce = start_engine(EngineType.COMPLETION, num_gpu_blocks=512, kv_store=store)
        writer = start_engine(EngineType.PROMPT)
        reader = start_engine(EngineType.PROMPT, kv_store=store)
        for pe in (writer, reader):
            connect(pe, ce)
        yield ce, writer, reader, client
        for engine in (reader, writer, ce):
            engine.close()


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


_ids = iter(range(10**6))


def _run(pe, ce, prompts, params) -> list:
    rids = [f"kv-s3-{next(_ids)}" for _ in prompts]
    for rid, prompt in zip(rids, prompts):
        submit(pe, ce, rid, prompt, params)
    done = wait_ce(ce, rids)
    return [done[r] for r in rids]


def _warm(cluster, prompt) -> None:
    ce, writer, _, _ = cluster
    _run(writer, ce, [prompt], greedy(4))
    wait_store_idle(ce)


def test_a_fresh_pe_computes_only_the_suffix_from_the_bucket(cluster):
    ce, _, reader, client = cluster
    prefix = _tokens(120, 1)
    second = prefix + [9, 10, 11, 12, 13]
    _warm(cluster, prefix + [5, 6, 7])
    assert sum(1 for k in objects(client, "kv-engines") if k.startswith("cluster/")) >= 15
    before = reader.call("stats")
    (out,) = _run(reader, ce, [second], greedy(10))
    assert out.outputs[0].token_ids == normal_reference([second], greedy(10))[0]
    assert reader.call("stats")["computed_prompt_tokens"] - before["computed_prompt_tokens"] == len(second) - 120
    assert out.num_cached_tokens == 120
    stats = wait_store_idle(reader)
    assert stats["hit_tokens_l3"] >= 120 and stats["corrupt_entries"] == 0 and stats["l3_bytes"] > 0


def test_a_damaged_object_is_counted_and_recomputed_with_identical_output(cluster):
    ce, _, reader, client = cluster
    prompt = _tokens(80, 2)
    _warm(cluster, prompt)
    key = reader.call("kv_store_paths", prompt)[4]  # block 4 of 10: the load stops there
    body = bytearray(client.get_object(Bucket="kv-engines", Key=key)["Body"].read())
    body[-3] ^= 0x55
    client.put_object(Bucket="kv-engines", Key=key, Body=bytes(body))
    before = reader.call("stats")
    corrupt_before = reader.call("kv_store_stats")["corrupt_entries"]
    (out,) = _run(reader, ce, [prompt + [1, 2]], greedy(8))
    assert out.outputs[0].token_ids == normal_reference([prompt + [1, 2]], greedy(8))[0]
    assert wait_store_idle(reader)["corrupt_entries"] == corrupt_before + 1
    assert out.num_cached_tokens == 4 * BS
    assert reader.call("stats")["computed_prompt_tokens"] - before["computed_prompt_tokens"] == 82 - 4 * BS
    assert key not in objects(client, "kv-engines")
