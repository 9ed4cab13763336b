"""The KV store in an S3-compatible bucket through `deepinfer serve` on a Ray cluster started
elsewhere (moto's S3 server on 127.0.0.1, NIXL's OBJ plugin in the engines): the engines get the
serve's AWS credentials, the decode engine's saves become objects, the store's metrics show the
bucket tier, and a fresh cluster on the same bucket loads what the first one saved, with the
shared P/D cluster's output."""

import pytest

from tests.helpers.s3 import require_obj_plugin

require_obj_plugin()

from tests.helpers.cluster import SMALL_ENGINE, ServeProcess, wait_until  # noqa: E402
from tests.helpers.s3 import make_bucket, objects, s3_server  # noqa: E402

PROMPT = " ".join(f"entry{i} is {i * 7 % 13}" for i in range(24)) + " and then"
"""Well over 4 blocks of 16 tokens."""


@pytest.fixture(scope="module")
def bucket():
    with s3_server() as endpoint:
        yield endpoint, make_bucket(endpoint, "kv-e2e")


def _serve(endpoint: str, ray_address: str) -> ServeProcess:
    return ServeProcess(
        "--kv-store-url", "s3://kv-e2e/run", "--kv-store-endpoint", endpoint, "--ray-address", ray_address,
        *SMALL_ENGINE,
    )  # fmt: skip


def _complete(serve: ServeProcess, prompt: str) -> dict:
    import httpx

    body = {"model": "deepinfer-tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{serve.base_url}/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_fresh_cluster_on_the_same_bucket_loads_what_the_first_saved(bucket, cluster):
    endpoint, client = bucket
    want = _complete(cluster, PROMPT)["choices"][0]["text"]
    first = _serve(endpoint, cluster.ray_address)
    try:
        assert _complete(first, PROMPT)["choices"][0]["text"] == want
        saved = wait_until(lambda: first.metric("deepinfer:kv_store_saved_bytes_total", role="decode"), 30)
        assert saved > 0
        stored = {k: n for k, n in objects(client, "kv-e2e").items() if k.startswith("run/")}
        assert len(stored) >= 4 and sum(stored.values()) == saved
        assert wait_until(lambda: first.metric("deepinfer:kv_store_bytes", tier="l3", role="decode") >= saved, 10)
    finally:
        first.stop()
    fresh = _serve(endpoint, cluster.ray_address)
    try:
        reply = _complete(fresh, PROMPT)
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64
        assert reply["choices"][0]["text"] == want
        hits = wait_until(lambda: fresh.metric("deepinfer:kv_store_hit_tokens_total", tier="l3") >= 64, 10)
        assert hits, fresh.metric("deepinfer:kv_store_hit_tokens_total", tier="l3")
        status = fresh.cli("status")
        assert status.returncode == 0 and "store hits l2" in status.stdout, status.stderr
    finally:
        fresh.stop()
