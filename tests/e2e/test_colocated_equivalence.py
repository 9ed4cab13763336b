"""Disaggregated (PE -> NIXL -> CE) output equals `serve --colocated` (one NORMAL engine) for
greedy requests, single and fanned out (n > 1). The colocated cluster also runs with an API key."""

import base64

import httpx
import openai
import pytest

from tests.helpers.cluster import SMALL_ENGINE, ServeProcess
from tests.helpers.images import make_png

KEY = "sesame"
PROMPTS = ["Hello, my name is", "The capital of France is", "x", "A much longer prompt " * 12]


@pytest.fixture(scope="module")
def colocated(cluster):
    serve = ServeProcess("--colocated", "--api-key", KEY, "--ray-address", cluster.ray_address, *SMALL_ENGINE)
    yield serve
    serve.stop()


def _outputs(serve: ServeProcess, **kw) -> list[list[str]]:
    client = openai.OpenAI(base_url=serve.base_url, api_key=KEY, max_retries=0, timeout=120)
    outs = []
    for prompt in PROMPTS:
        r = client.completions.create(model="deepinfer-tiny", prompt=prompt, max_tokens=16, **kw)
        outs.append([c.text for c in sorted(r.choices, key=lambda c: c.index)])
    return outs


def test_greedy_disaggregated_equals_colocated(cluster, colocated):
    greedy = dict(temperature=0, extra_body={"ignore_eos": True})
    assert _outputs(cluster, **greedy) == _outputs(colocated, **greedy)


def test_greedy_fan_out_equals_colocated(cluster, colocated):
    greedy = dict(temperature=0, n=2, extra_body={"ignore_eos": True, "stop": ["e"]})
    outs = _outputs(cluster, **greedy)
    assert outs == _outputs(colocated, **greedy)
    assert all(a == b for a, b in outs)


def test_images_disaggregated_through_an_encoder_equal_a_normal_engine_encoding_in_process(cluster, colocated):
    """E -> P -> D (the shared cluster has a vision encoder) against `--colocated`, where the
    NORMAL engine encodes the image itself (and no encoder pool is started)."""
    url = "data:image/png;base64," + base64.b64encode(make_png(44, 38, seed=21)).decode()
    content = [{"type": "text", "text": "what is it?"}, {"type": "image_url", "image_url": {"url": url}}]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    answers = []
    for serve, headers in ((cluster, {}), (colocated, {"Authorization": f"Bearer {KEY}"})):
        r = httpx.post(f"{serve.base_url}/chat/completions", json=body, headers=headers, timeout=120)
        assert r.status_code == 200, r.text
        answers.append((r.json()["choices"][0]["message"]["content"], r.json()["usage"]["prompt_tokens"]))
    assert answers[0] == answers[1]
    assert colocated.metric("deepinfer:encoder_images_total") == 0


def test_api_key_is_required_except_for_health_and_metrics(colocated):
    body = {"prompt": "x", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(f"{colocated.base_url}/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{colocated.base_url}/models", timeout=30).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=colocated.base_url, api_key="wrong", max_retries=0).models.list()
    assert httpx.get(f"{colocated.url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{colocated.url}/metrics", timeout=10).status_code == 200
    ok = httpx.post(
        f"{colocated.base_url}/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
    )
    assert ok.status_code == 200


def test_colocated_status(colocated):
    assert colocated.cli("status").returncode != 0  # the admin API needs the key too
    r = colocated.cli("status", "--api-key", KEY)
    assert r.returncode == 0, r.stderr
    assert "colocated pool: 1 worker(s)" in r.stdout and "ready" in r.stdout
