"""Images through the running cluster (the embedded model has a CLIP tower): chat `image_url`
parts over HTTP and image parts over gRPC give what the NORMAL engine in this process gives;
`usage.prompt_tokens` counts image tokens; every bad image is a 400 naming the part, and the
server serves after each."""

import base64

import grpc
import httpx
import pytest

from deepinfer_core import LLM, SamplingParams
from deepinfer_proto import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.helpers.cluster import wait_until
from tests.helpers.images import make_png

MAX_NEW = 6


def data_url(png: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(png).decode("ascii")


def chat(*parts) -> list[dict]:
    content = [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]
    return [{"role": "user", "content": content}]


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


A, B = make_png(48, 40, seed=1), make_png(30, 52, seed=2)
CONVERSATIONS = {
    "one image": chat("What is this?", image_part(data_url(A))),
    "two images": chat(image_part(data_url(B)), "and", image_part(data_url(A)), "compare"),
    "text only": chat("Describe nothing"),
}


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=512, num_gpu_blocks=128)


@pytest.fixture(scope="module")
def reference(llm):
    """Greedy token ids and expanded prompt length of each conversation, NORMAL engine in process."""
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = {name: llm.chat(messages, params)[0] for name, messages in CONVERSATIONS.items()}
    return {name: (o.outputs[0].token_ids, len(o.prompt_token_ids), o.outputs[0].text) for name, o in outs.items()}


def _post(cluster, messages, **extra) -> httpx.Response:
    body = {"messages": messages, "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True, **extra}
    return httpx.post(f"{cluster.base_url}/chat/completions", json=body, timeout=120)


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_chat_with_images_equals_the_engine_in_process(cluster, reference, name):
    r = _post(cluster, CONVERSATIONS[name])
    assert r.status_code == 200, r.text
    tokens, prompt_len, text = reference[name]
    assert r.json()["choices"][0]["message"]["content"] == text
    assert r.json()["usage"]["prompt_tokens"] == prompt_len  # image tokens counted


def test_grpc_chat_with_image_bytes(cluster, reference):
    parts = [
        gateway_pb2.ContentPart(image=B),
        gateway_pb2.ContentPart(text="and"),
        gateway_pb2.ContentPart(image=A),
        gateway_pb2.ContentPart(text="compare"),
    ]
    request = gateway_pb2.GenerateRequest(
        chat=gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role="user", parts=parts)]),
        params=common_pb2.SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True),
    )
    with grpc.insecure_channel(cluster.grpc_address) as ch:
        replies = list(gateway_pb2_grpc.GatewayStub(ch).Generate(request, timeout=120))
    tokens, prompt_len, _ = reference["two images"]
    assert [t for r in replies for t in r.delta.token_ids] == tokens
    assert replies[-1].usage.prompt_tokens == prompt_len


def _bad_cases(tmp_dir) -> dict:
    png = make_png(seed=3)
    return {
        "truncated PNG": (data_url(png[: len(png) // 2]), "does not decode"),
        "not an image": (data_url(b"certainly not an image" * 4), "does not decode"),
        "bad base64": ("data:image/png;base64,@@@not-base64@@@", "base64"),
        "not a data URL": ("data:image/png,raw", "data URL"),
        "file outside the allowed dir": ("file:///etc/hostname", "file://"),
        "http with fetching off": ("http://127.0.0.1:9/cat.png", "not fetched"),
        "unknown scheme": ("ftp://x/y.png", "scheme"),
    }


def test_bad_images_are_400_with_a_message_and_the_server_stays_healthy(cluster, tmp_path):
    for name, (url, words) in _bad_cases(tmp_path).items():
        r = _post(cluster, chat("look", image_part(url)), max_tokens=2)
        assert r.status_code == 400, (name, r.text)
        error = r.json()["error"]
        assert words in error["message"] and error["param"] == "messages[0].content[1]", (name, error)
    too_many = chat(*[image_part(data_url(A))] * 9)
    r = _post(cluster, too_many, max_tokens=2)
    assert r.status_code == 400 and "limit is 8" in r.json()["error"]["message"]
    assert _post(cluster, CONVERSATIONS["one image"]).status_code == 200
    assert httpx.get(f"{cluster.url}/health", timeout=10).status_code == 200


def test_images_went_through_the_encoder_pool(cluster):
    """The cluster serves the embedded model P/D, so one vision encoder encodes its images; a
    repeated image comes from its cache; the PE read the embeddings over NIXL."""
    for _ in range(2):
        assert _post(cluster, CONVERSATIONS["one image"]).status_code == 200
    # worker-load metrics: the router reads the encoders' loads every 0.5 s
    assert wait_until(lambda: cluster.metric("deepinfer:encoder_images_total") >= 1, timeout_s=10)
    assert wait_until(lambda: cluster.metric("deepinfer:encoder_cache_hits_total") >= 1, timeout_s=10)
    assert cluster.metric("deepinfer:embedding_transfer_seconds_count") >= 1
    assert wait_until(lambda: cluster.metric("deepinfer:encoder_queue_images") == 0, timeout_s=10)


def test_a_burst_of_image_requests_each_completes_or_gets_429(cluster):
    """64 requests at once, each with its own image, on one vision encoder: none is dropped or
    hangs (each answers within the client's bound), and the encoder's queue ends empty."""
    import asyncio

    async def one(client: httpx.AsyncClient, i: int) -> int:
        body = {"messages": chat("see", image_part(data_url(make_png(24, 24, seed=100 + i)))), "max_tokens": 1}
        return (await client.post(f"{cluster.base_url}/chat/completions", json=body)).status_code

    async def burst() -> list[int]:
        async with httpx.AsyncClient(timeout=180, limits=httpx.Limits(max_connections=64)) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    codes = asyncio.run(asyncio.wait_for(burst(), 240))
    assert set(codes) <= {200, 429} and codes.count(200) >= 1, codes
    assert wait_until(lambda: cluster.metric("deepinfer:encoder_queue_images") == 0, timeout_s=10)
    # every PE read its leases (or they were released): the encoder's pool is empty again
    assert wait_until(lambda: cluster.metric("deepinfer:embedding_leases") == 0, timeout_s=10)


def test_the_encoder_pool_empties_after_clients_leave_early(cluster):
    """Clients that go away while their images are being decoded, encoded or read (where exactly
    depends on timing: tests/services/test_encoder_core.py pins each case) leave no lease behind."""
    images = [image_part(data_url(make_png(256, 256, seed=300 + i))) for i in range(8)]
    for _ in range(3):
        try:
            body = {"messages": chat("many", *images), "max_tokens": 50, "stream": True}
            with httpx.stream("POST", f"{cluster.base_url}/chat/completions", json=body, timeout=0.05) as r:
                r.read()
        except httpx.TimeoutException:
            pass  # the client is gone
    assert wait_until(lambda: cluster.metric("deepinfer:embedding_leases") == 0, timeout_s=15)
    assert wait_until(lambda: cluster.metric("deepinfer:encoder_queue_images") == 0, timeout_s=10)
    assert _post(cluster, CONVERSATIONS["one image"]).status_code == 200
