"""Bad input gets the documented status and an OpenAI-style error body; the server stays healthy."""

import httpx
import pytest

CASES = [
    # (description, endpoint, raw body or JSON, status, param)
    ("malformed JSON", "completions", b'{"prompt": "x", ', 400, None),
    ("not an object", "completions", b"[1, 2]", 400, None),
    ("wrong type: max_tokens", "completions", {"prompt": "x", "max_tokens": "ten"}, 422, "max_tokens"),
    ("wrong type: prompt", "completions", {"prompt": 3.5}, 422, "prompt"),
    ("wrong type: messages", "chat/completions", {"messages": "hi"}, 422, "messages"),
    ("missing messages", "chat/completions", {"model": "deepinfer-tiny"}, 422, "messages"),
    ("unknown model", "completions", {"model": "gpt-9", "prompt": "x"}, 404, "model"),
    ("prompt over the context length", "completions", {"prompt": "hello " * 600}, 413, "prompt"),
    ("prompt + max_tokens over the context", "completions", {"prompt": "hi", "max_tokens": 600}, 400, "max_tokens"),
    ("max_tokens < 1", "completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    (
        "max_completion_tokens < 1",
        "chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
        400,
        "max_tokens",
    ),
    ("temperature < 0", "completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    (
        "temperature > 2",
        "chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "temperature": 3},
        400,
        "temperature",
    ),
    ("top_p = 0", "completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("top_p > 1", "completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("n too large", "completions", {"prompt": "x", "n": 1000}, 400, "n"),
    ("n < 1", "completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("token id outside the vocabulary", "completions", {"prompt": [1, 2, 999999]}, 400, "prompt"),
    ("empty prompt", "completions", {"prompt": ""}, 400, "prompt"),
    ("empty messages", "chat/completions", {"messages": []}, 400, "messages"),
    ("logprobs too large", "completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    (
        "top_logprobs without logprobs",
        "chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        400,
        "top_logprobs",
    ),
]


@pytest.mark.parametrize("name,endpoint,body,status,param", CASES, ids=[c[0] for c in CASES])
def test_bad_request_gets_error_json_and_the_server_stays_healthy(cluster, name, endpoint, body, status, param):
    url = f"{cluster.base_url}/{endpoint}"
    if isinstance(body, bytes):
        r = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=30)
    else:
        r = httpx.post(url, json=body, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param or error["param"].startswith(param), error
    assert httpx.get(f"{cluster.url}/health", timeout=10).status_code == 200
    ok = httpx.post(f"{cluster.base_url}/completions", json={"prompt": "ok", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_unknown_route_is_404_json(cluster):
    r = httpx.get(f"{cluster.base_url}/nothing", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["message"]


def test_a_bad_image_part_is_refused_at_the_gateway_and_never_retried(cluster):
    """An image part that holds no image is the client's mistake, named, before any stage sees it
    (tests/e2e/test_images.py has the whole matrix)."""
    retries = cluster.metric("deepinfer:router_retries_total")
    content = [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 4}
    r = httpx.post(f"{cluster.base_url}/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "messages[0].content[1]" and "data URL" in error["message"], error
    assert error["type"] == "invalid_request_error"
    assert cluster.metric("deepinfer:router_retries_total") == retries
