"""The KV cache system through `deepinfer serve` (2 PEs + 1 CE, a store directory of the test's own):
short prompts are prefilled on the CE (conditional disaggregation), a prompt sharing a prefix goes
to the PE that holds it, a prompt the CE mostly holds is finished there, the store's metrics and
`deepinfer status` show each tier, and a fresh cluster on the same directory loads what the first
one saved. Every output equals the shared P/D cluster's (store and local prefill off there)."""

import re

import httpx
import pytest

from tests.helpers.cluster import SMALL_ENGINE, ServeProcess, metric_value, wait_until

LOCAL = 20
"""--local-prefill-tokens of the cluster under test."""
BASE = " ".join(f"entry{i} is {i * 7 % 13}" for i in range(24))
"""A prompt of well over 4 chunks of 16 tokens."""
FAR = BASE + " " + " ".join(f"then {i} more" for i in range(20))
"""BASE and a suffix longer than LOCAL: its uncached part goes to a PE."""
NEAR = BASE + " and one"
"""BASE and a suffix shorter than LOCAL: the CE that holds BASE prefills it."""


def _serve(store_dir, ray_address) -> ServeProcess:
    return ServeProcess(
        "--prefill", "2", "--local-prefill-tokens", str(LOCAL), "--kv-store-dir", str(store_dir),
        "--ray-address", ray_address, *SMALL_ENGINE,
    )  # fmt: skip


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kv-store")


@pytest.fixture(scope="module")
def served(cluster, store_dir):
    serve = _serve(store_dir, cluster.ray_address)
    yield serve
    serve.stop()


def _complete(serve: ServeProcess, prompt: str, max_tokens: int = 8) -> dict:
    body = {"model": "deepinfer-tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{serve.base_url}/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _text(serve, prompt: str) -> str:
    return _complete(serve, prompt)["choices"][0]["text"]


def _cached(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def _reaches(serve: ServeProcess, name: str, value: float, **labels) -> float:
    """A worker-load metric once the router has polled the change (it reads loads every 0.5 s)."""
    return wait_until(lambda: (v := serve.metric(name, **labels)) >= value and v, 10) or serve.metric(name, **labels)


def _prefill_decisions(serve: ServeProcess) -> dict[str, float]:
    text = httpx.get(f"{serve.url}/metrics", timeout=10).text
    pattern = r'^deepinfer:router_decisions_total\{pool="prefill",worker="([^"]+)"\} (\S+)$'
    return {m.group(1): float(m.group(2)) for m in re.finditer(pattern, text, re.M)}


def test_a_short_prompt_is_prefilled_on_the_decode_engine(served, cluster):
    handoffs = served.metric("deepinfer:handoffs_total", role="prefill")
    local = served.metric("deepinfer:local_prefills_total")
    reply = _complete(served, "Hello, my name is")
    assert reply["usage"]["prompt_tokens"] <= LOCAL
    assert _reaches(served, "deepinfer:local_prefills_total", local + 1) == local + 1
    assert served.metric("deepinfer:handoffs_total", role="prefill") == handoffs
    assert reply["choices"][0]["text"] == _text(cluster, "Hello, my name is")


def test_a_shared_prefix_goes_to_the_prefill_engine_that_holds_it(served, cluster):
    before = _prefill_decisions(served)
    assert _text(served, BASE) == _text(cluster, BASE)
    after_base = _prefill_decisions(served)
    holder = next(w for w, n in after_base.items() if n > before.get(w, 0))
    reply = _complete(served, FAR)
    after_far = _prefill_decisions(served)
    assert after_far[holder] == after_base[holder] + 1, (before, after_base, after_far)
    assert _cached(reply) >= 64  # BASE's full blocks, from the holder's prefix cache
    assert reply["choices"][0]["text"] == _text(cluster, FAR)


def test_a_prompt_the_decode_engine_mostly_holds_is_finished_there(served, cluster):
    local = served.metric("deepinfer:local_prefills_total")
    reply = _complete(served, NEAR)
    assert reply["usage"]["prompt_tokens"] > LOCAL
    assert _reaches(served, "deepinfer:local_prefills_total", local + 1) == local + 1
    assert _cached(reply) >= 64
    assert reply["choices"][0]["text"] == _text(cluster, NEAR)


def test_store_metrics_and_status_show_each_tier(served):
    text = httpx.get(f"{served.url}/metrics", timeout=10).text
    for series in (
        'deepinfer:kv_store_hit_tokens_total{role="prefill"',
        'deepinfer:kv_store_bytes{role="decode"',
        'deepinfer:kv_store_evictions_total{role="prefill"',
        "deepinfer:kv_store_miss_tokens_total{",
        "deepinfer:kv_store_corrupt_total{",
        "deepinfer:kv_store_load_seconds_count{",
        "deepinfer:local_prefills_total{",
    ):
        assert series in text, series
    assert 'tier="l2"' in text and 'tier="l3"' in text
    assert metric_value(text, "deepinfer:kv_store_capacity_bytes", tier="l2") > 0
    r = served.cli("status")
    assert r.returncode == 0, r.stderr
    assert "prefill choice" in r.stdout and "store hits l2" in r.stdout and "local prefills" in r.stdout


def test_a_fresh_cluster_on_the_same_directory_loads_what_the_first_saved(served, cluster, store_dir):
    saved = wait_until(lambda: served.metric("deepinfer:kv_store_saved_bytes_total", role="decode"), 30)
    assert saved > 0
    served.stop()
    fresh = _serve(store_dir, cluster.ray_address)
    try:
        reply = _complete(fresh, FAR)
        assert _cached(reply) >= 64
        assert _reaches(fresh, "deepinfer:kv_store_hit_tokens_total", 64, tier="l3") >= 64
        assert reply["choices"][0]["text"] == _text(cluster, FAR)
    finally:
        fresh.stop()
