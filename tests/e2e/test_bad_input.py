"""The bad-input matrix, over HTTP and gRPC against `deepinfer serve`: every client error is a 4xx
(or its gRPC status) with a message naming the field, on a connection that stays open, and the
server stays healthy after each."""

import json

import grpc
import httpx
import pytest

from deepinfer_proto import common_pb2, gateway_pb2, gateway_pb2_grpc

USER = [{"role": "user", "content": "x"}]
BIG = 8 * 1024 * 1024 + 10


def _raw(text: str) -> bytes:
    """A JSON body written by hand: escapes such as a lone surrogate, or NaN, that `json=` cannot send."""
    return text.encode()


HTTP_CASES = [
    # (description, endpoint, body (JSON, raw bytes, or (bytes, content type)), status, param)
    ("malformed JSON", "completions", b'{"prompt": "x", ', 400, None),
    ("not an object", "completions", b"[1, 2]", 400, None),
    ("invalid UTF-8 in the body", "completions", b'{"prompt": "\xff\xfe"}', 400, None),
    ("wrong type: max_tokens", "completions", {"prompt": "x", "max_tokens": "ten"}, 422, "max_tokens"),
    ("wrong type: prompt", "completions", {"prompt": 3.5}, 422, "prompt"),
    ("unknown model", "completions", {"model": "gpt-9", "prompt": "x"}, 404, "model"),
    ("prompt over the context length", "completions", {"prompt": "hello " * 600}, 413, "prompt"),
    ("prompt + max_tokens over the context", "completions", {"prompt": "hi", "max_tokens": 600}, 400, "max_tokens"),
    ("max_tokens < 1", "completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens 2**40", "completions", {"prompt": "x", "max_tokens": 2**40}, 400, "max_tokens"),
    ("temperature < 0", "completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("temperature NaN", "completions", _raw('{"prompt": "x", "temperature": NaN}'), 400, "temperature"),
    ("temperature Infinity", "completions", _raw('{"prompt": "x", "temperature": Infinity}'), 400, "temperature"),
    ("top_p = 0", "completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("top_p > 1", "completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("n too large", "completions", {"prompt": "x", "n": 1000}, 400, "n"),
    ("n 1e12", "completions", {"prompt": "x", "n": 1e12}, 400, "n"),
    ("n < 1", "completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("token id outside the vocabulary", "completions", {"prompt": [1, 2, 999999]}, 400, "prompt"),
    ("negative token id", "completions", {"prompt": [1, -1]}, 400, "prompt"),
    ("token id 2**40", "completions", {"prompt": [[1, 2**40]]}, 400, "prompt"),
    ("empty prompt", "completions", {"prompt": ""}, 400, "prompt"),
    ("logprobs too large", "completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("logprobs < 0", "completions", {"prompt": "x", "logprobs": -1}, 400, "logprobs"),
    ("lone surrogate in the prompt", "completions", _raw('{"prompt": "a\\ud800b"}'), 400, "prompt"),
    ("lone surrogate in a prompt list", "completions", _raw('{"prompt": ["ok", "\\udfff"]}'), 400, "prompt[1]"),
    ("lone surrogate in stop", "completions", _raw('{"prompt": "x", "stop": "\\ud800"}'), 400, "stop"),
    ("lone surrogate in a key", "completions", _raw('{"prompt": "x", "\\ud800": 1}'), 400, None),
    ("top_k 1e12", "completions", {"prompt": "x", "top_k": 1e12}, 400, "top_k"),
    ("top_k < -1", "completions", {"prompt": "x", "top_k": -5}, 400, "top_k"),
    ("seed 2**70", "completions", {"prompt": "x", "seed": 2**70}, 400, "seed"),
    ("stop_token_ids [1e12]", "completions", {"prompt": "x", "stop_token_ids": [1e12]}, 400, "stop_token_ids"),
    (
        "stop token outside the vocabulary",
        "completions",
        {"prompt": "x", "stop_token_ids": [5000]},
        400,
        "stop_token_ids",
    ),
    ("empty stop string", "completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("min_tokens 2**40", "completions", {"prompt": "x", "min_tokens": 2**40}, 400, "min_tokens"),
    (
        "min_tokens over the context",
        "completions",
        {"prompt": "x", "min_tokens": 600, "max_tokens": None},
        400,
        "min_tokens",
    ),
    ("presence_penalty > 2", "completions", {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    ("repetition_penalty 0", "completions", {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("echo", "completions", {"prompt": "x", "echo": True}, 400, "echo"),
    ("suffix", "completions", {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("logit_bias", "completions", {"prompt": "x", "logit_bias": {"1": 5}}, 400, "logit_bias"),
    ("prompt_logprobs", "completions", {"prompt": "x", "prompt_logprobs": 1}, 400, "prompt_logprobs"),
    (
        "response_format on completions",
        "completions",
        {"prompt": "x", "response_format": {"type": "json_object"}},
        400,
        "response_format",
    ),
    ("guided_json", "completions", {"prompt": "x", "guided_json": {"type": "object"}}, 400, "guided_json"),
    ("best_of other than n", "completions", {"prompt": "x", "best_of": 3}, 400, "best_of"),
    ("a form body", "completions", (b"prompt=x", "application/x-www-form-urlencoded"), 415, None),
    ("JSON sent as text/plain", "completions", (b'{"prompt": "x"}', "text/plain"), 415, None),
    ("body over the size limit", "completions", json.dumps({"prompt": "x" * BIG}).encode(), 413, None),
    ("wrong type: messages", "chat/completions", {"messages": "hi"}, 422, "messages"),
    ("missing messages", "chat/completions", {"model": "deepinfer-tiny"}, 422, "messages"),
    ("empty messages", "chat/completions", {"messages": []}, 400, "messages"),
    (
        "max_completion_tokens < 1",
        "chat/completions",
        {"messages": USER, "max_completion_tokens": 0},
        400,
        "max_completion_tokens",
    ),
    ("temperature > 2", "chat/completions", {"messages": USER, "temperature": 3}, 400, "temperature"),
    ("top_logprobs without logprobs", "chat/completions", {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs"),
    (
        "top_logprobs too large",
        "chat/completions",
        {"messages": USER, "logprobs": True, "top_logprobs": 50},
        400,
        "top_logprobs",
    ),
    (
        "lone surrogate in content",
        "chat/completions",
        _raw('{"messages": [{"role": "user", "content": "\\ud800"}]}'),
        400,
        "messages[0].content",
    ),
    (
        "lone surrogate in a text part",
        "chat/completions",
        _raw('{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}'),
        400,
        "messages[0].content[0]",
    ),
    (
        "lone surrogate in a chat stop",
        "chat/completions",
        _raw('{"messages": [{"role": "user", "content": "x"}], "stop": ["\\ud800"]}'),
        400,
        "stop",
    ),
    ("unknown role", "chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ("empty role", "chat/completions", {"messages": [{"role": "", "content": "x"}]}, 400, "messages[0].role"),
    ("tool role", "chat/completions", {"messages": [*USER, {"role": "tool", "content": "4"}]}, 400, "messages[1].role"),
    (
        "tool_calls in a message",
        "chat/completions",
        {"messages": [{"role": "assistant", "tool_calls": [{"id": "1"}]}]},
        400,
        "messages[0].tool_calls",
    ),
    (
        "tools",
        "chat/completions",
        {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}]},
        400,
        "tools",
    ),
    ("tool_choice auto", "chat/completions", {"messages": USER, "tool_choice": "auto"}, 400, "tool_choice"),
    (
        "tool_choice a function",
        "chat/completions",
        {"messages": USER, "tool_choice": {"type": "function", "function": {"name": "f"}}},
        400,
        "tool_choice",
    ),
    ("functions", "chat/completions", {"messages": USER, "functions": [{"name": "f"}]}, 400, "functions"),
    ("function_call", "chat/completions", {"messages": USER, "function_call": "auto"}, 400, "function_call"),
    (
        "response_format json_object",
        "chat/completions",
        {"messages": USER, "response_format": {"type": "json_object"}},
        400,
        "response_format",
    ),
    (
        "response_format json_schema",
        "chat/completions",
        {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {}}},
        400,
        "response_format",
    ),
    (
        "response_format nonsense",
        "chat/completions",
        {"messages": USER, "response_format": {"type": "nonsense"}},
        400,
        "response_format",
    ),
    (
        "unknown part type",
        "chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
        400,
        "messages[0].content[0]",
    ),
    (
        "text part without text",
        "chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
        400,
        "messages[0].content[0]",
    ),
    (
        "conversation over the context",
        "chat/completions",
        {"messages": [{"role": "user", "content": "hello " * 600}]},
        413,
        "messages",
    ),
    ("chat as text/plain", "chat/completions", (b'{"messages": []}', "text/plain; charset=utf-8"), 415, None),
]


@pytest.fixture(scope="module")
def client(cluster):
    with httpx.Client(base_url=cluster.url, timeout=60) as c:
        yield c


def _post(client: httpx.Client, endpoint: str, body) -> httpx.Response:
    url = f"/v1/{endpoint}"
    if isinstance(body, tuple):
        return client.post(url, content=body[0], headers={"content-type": body[1]})
    if isinstance(body, bytes):
        return client.post(url, content=body, headers={"content-type": "application/json"})
    return client.post(url, json=body)


def _local_address(r: httpx.Response):
    return r.extensions["network_stream"].get_extra_info("client_addr")


def _still_served(client: httpx.Client, bad: httpx.Response) -> None:
    """The same connection answers a good request after the bad one: nothing was closed or reset."""
    ok = client.post("/v1/completions", json={"prompt": "ok", "max_tokens": 1})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 1
    assert _local_address(ok) == _local_address(bad)
    assert client.get("/health").status_code == 200


@pytest.mark.parametrize("name,endpoint,body,status,param", HTTP_CASES, ids=[c[0] for c in HTTP_CASES])
def test_bad_http_request_is_a_4xx_naming_the_field_on_a_live_connection(client, name, endpoint, body, status, param):
    r = _post(client, endpoint, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error", error
    if param is not None:
        assert error["param"] == param or error["param"].startswith(param), error
    assert "connection" not in r.headers or r.headers["connection"] != "close"
    _still_served(client, r)


@pytest.mark.parametrize(
    "method,path", [("GET", "/v1/completions"), ("PUT", "/v1/chat/completions"), ("POST", "/v1/models")]
)
def test_a_wrong_method_is_405_with_allow(client, method, path):
    r = client.request(method, path)
    assert r.status_code == 405 and r.headers["allow"], r.text
    assert method in r.json()["error"]["message"] and r.headers["allow"] in r.json()["error"]["message"]
    _still_served(client, r)


def test_unknown_route_is_404_json(client):
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["message"]
    _still_served(client, r)


def test_a_bad_image_part_is_refused_at_the_gateway_and_never_retried(cluster, client):
    """An image part that holds no image is the client's mistake, named, before any stage sees it
    (tests/e2e/test_images.py has the whole matrix)."""
    retries = cluster.metric("deepinfer:router_retries_total")
    content = [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}], "max_tokens": 4})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "messages[0].content[1]" and "data URL" in error["message"], error
    assert error["type"] == "invalid_request_error"
    assert cluster.metric("deepinfer:router_retries_total") == retries


# ---- gRPC ------------------------------------------------------------------------------------------


def _request(params=None, **prompt) -> gateway_pb2.GenerateRequest:
    prompt = prompt or {"text": "x"}
    return gateway_pb2.GenerateRequest(params=common_pb2.SamplingParams(**(params or {})), **prompt)


def _chat(*messages: tuple[str, str]) -> dict:
    return {
        "chat": gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role=r, content=c) for r, c in messages])
    }


def _with_bad_utf8(request: gateway_pb2.GenerateRequest, placeholder: bytes) -> bytes:
    """`request` serialized, its `placeholder` string bytes swapped for bytes that are not UTF-8."""
    data = request.SerializeToString()
    assert placeholder in data
    return data.replace(placeholder, b"\xff\xfe")


_VALID = _request(text="ok").SerializeToString()
INVALID = grpc.StatusCode.INVALID_ARGUMENT
GRPC_CASES = [
    # (description, request or raw bytes, status, words the message holds)
    ("max_tokens < 0", _request({"max_tokens": -1}), INVALID, "max_tokens"),
    ("top_p > 1", _request({"top_p": 1.5}), INVALID, "top_p"),
    ("no prompt", gateway_pb2.GenerateRequest(), INVALID, "text, token_ids or chat"),
    ("empty text", _request(text=""), INVALID, "empty"),
    ("text over the context length", _request(text="x" * 3000), INVALID, "context length"),
    ("unknown model", gateway_pb2.GenerateRequest(model="nope", text="x"), grpc.StatusCode.NOT_FOUND, "nope"),
    ("corrupt protobuf", b"\xff\xff\xff\xff", INVALID, "does not parse"),
    ("truncated protobuf", _VALID[:-1], INVALID, "does not parse"),
    ("invalid UTF-8 in text", _with_bad_utf8(_request(text="\x01\x02"), b"\x01\x02"), INVALID, "does not parse"),
    ("invalid UTF-8 in chat", _with_bad_utf8(_request(**_chat(("user", "\x01\x02"))), b"\x01\x02"), INVALID, "parse"),
    (
        "invalid UTF-8 in model",
        _with_bad_utf8(gateway_pb2.GenerateRequest(model="\x01\x02", text="x"), b"\x01\x02"),
        INVALID,
        "parse",
    ),
    ("prompt_logprobs", _request({"prompt_logprobs": 1}), INVALID, "prompt_logprobs"),
    ("stop token outside the vocabulary", _request({"stop_token_ids": [2**31 - 1]}), INVALID, "stop_token_ids"),
    ("token id outside the vocabulary", _request(token_ids=gateway_pb2.TokenIds(ids=[1, 99999])), INVALID, "prompt"),
    ("negative token id", _request(token_ids=gateway_pb2.TokenIds(ids=[-1])), INVALID, "prompt"),
    ("empty token ids", _request(token_ids=gateway_pb2.TokenIds()), INVALID, "empty"),
    ("tool role", _request(**_chat(("user", "x"), ("tool", "4"))), INVALID, "role"),
    ("empty role", _request(**_chat(("", "x"))), INVALID, "role"),
    ("unknown role", _request(**_chat(("robot", "x"))), INVALID, "role"),
    ("empty chat", _request(chat=gateway_pb2.ChatMessages()), INVALID, "messages"),
    ("n = 0", _request({"n": 0}), INVALID, "n must be"),
    ("n too large", _request({"n": 4000000000}), INVALID, "n must be"),
    ("temperature NaN", _request({"temperature": float("nan")}), INVALID, "temperature"),
    ("temperature inf", _request({"temperature": float("inf")}), INVALID, "temperature"),
    ("presence_penalty > 2", _request({"presence_penalty": 5}), INVALID, "presence_penalty"),
    ("repetition_penalty 0", _request({"repetition_penalty": 0}), INVALID, "repetition_penalty"),
    ("logprobs too large", _request({"logprobs": 50}), INVALID, "logprobs"),
    ("min_tokens < 0", _request({"min_tokens": -1}), INVALID, "min_tokens"),
    ("min_tokens over the context", _request({"min_tokens": 600}), INVALID, "min_tokens"),
    ("top_k < -1", _request({"top_k": -5}), INVALID, "top_k"),
    ("empty stop string", _request({"stop": [""]}), INVALID, "stop"),
]


@pytest.fixture(scope="module")
def channel(cluster):
    with grpc.insecure_channel(cluster.grpc_address) as ch:
        yield ch


@pytest.mark.parametrize("name,request_,status,needle", GRPC_CASES, ids=[c[0] for c in GRPC_CASES])
def test_bad_grpc_request_is_a_client_status_with_a_message(channel, name, request_, status, needle):
    raw = isinstance(request_, bytes)
    generate = channel.unary_stream(
        "/deepinfer.v1.Gateway/Generate",
        request_serializer=None if raw else gateway_pb2.GenerateRequest.SerializeToString,
        response_deserializer=gateway_pb2.GenerateResponse.FromString,
    )
    with pytest.raises(grpc.RpcError) as e:
        list(generate(request_, timeout=30))
    assert e.value.code() == status, e.value.details()
    assert needle in e.value.details(), e.value.details()
    stub = gateway_pb2_grpc.GatewayStub(channel)  # the same channel still serves
    assert stub.Health(gateway_pb2.HealthCheckRequest(), timeout=10).ready
    replies = list(stub.Generate(_request({"max_tokens": 1}, text="ok"), timeout=60))
    assert replies[-1].usage.completion_tokens == 1


def test_the_matrix_has_at_least_60_cases():
    assert len(HTTP_CASES) + len(GRPC_CASES) >= 60
