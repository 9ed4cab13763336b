"""The gateway's gRPC API: Generate (stream), Health, Models, errors as statuses, reflection."""

import grpc
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from deepinfer_core import LLM, SamplingParams
from deepinfer_proto import common_pb2, gateway_pb2, gateway_pb2_grpc


@pytest.fixture(scope="module")
def channel(cluster):
    with grpc.insecure_channel(cluster.grpc_address) as ch:
        yield ch


def test_generate_streams_what_the_engine_generates(channel):
    stub = gateway_pb2_grpc.GatewayStub(channel)
    params = common_pb2.SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    replies = list(stub.Generate(gateway_pb2.GenerateRequest(text="Hello, my name is", params=params), timeout=60))
    tokens = [t for r in replies for t in r.delta.token_ids]
    want = LLM(max_model_len=512, num_gpu_blocks=64).generate(
        "Hello, my name is", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    )[0]
    assert tokens == want.outputs[0].token_ids
    assert "".join(r.delta.text for r in replies) == want.outputs[0].text
    assert replies[-2].delta.finish_reason == "length"
    assert replies[-1].usage.completion_tokens == 10 and replies[-1].usage.prompt_tokens == len(want.prompt_token_ids)
    assert len({r.request_id for r in replies}) == 1


def test_chat_and_token_id_prompts(channel):
    stub = gateway_pb2_grpc.GatewayStub(channel)
    params = common_pb2.SamplingParams(temperature=0, max_tokens=3)
    chat = gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role="user", content="hi")])
    assert list(stub.Generate(gateway_pb2.GenerateRequest(chat=chat, params=params), timeout=60))[
        -1
    ].usage.prompt_tokens
    ids = gateway_pb2.TokenIds(ids=[5, 6, 7])
    replies = list(stub.Generate(gateway_pb2.GenerateRequest(token_ids=ids, params=params), timeout=60))
    assert replies[-1].usage.prompt_tokens == 3


def test_errors_are_statuses_with_messages(channel):
    stub = gateway_pb2_grpc.GatewayStub(channel)
    cases = [
        (gateway_pb2.GenerateRequest(text="x", params=common_pb2.SamplingParams(max_tokens=-1)), "max_tokens"),
        (gateway_pb2.GenerateRequest(text="x", params=common_pb2.SamplingParams(top_p=1.5)), "top_p"),
        (gateway_pb2.GenerateRequest(params=common_pb2.SamplingParams()), "text, token_ids or chat"),
        (gateway_pb2.GenerateRequest(text="x" * 3000), "context length"),
    ]
    for request, needle in cases:
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(request, timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(gateway_pb2.GenerateRequest(model="nope", text="x"), timeout=30))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_prompt_the_prefill_engine_refuses_is_invalid_argument_and_not_retried(cluster, channel):
    """An image placeholder without an image reaches the PE, which refuses it as the client's fault."""
    stub = gateway_pb2_grpc.GatewayStub(channel)
    retries = cluster.metric("deepinfer:router_retries_total")
    request = gateway_pb2.GenerateRequest(text="look at <|image|> this", params=common_pb2.SamplingParams(max_tokens=3))
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(request, timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "image placeholder" in e.value.details()
    assert "prefill failed" not in e.value.details()
    assert cluster.metric("deepinfer:router_retries_total") == retries


def test_health_models_and_reflection(channel):
    stub = gateway_pb2_grpc.GatewayStub(channel)
    assert stub.Health(gateway_pb2.HealthCheckRequest(), timeout=10).ready
    assert stub.Models(gateway_pb2.ModelsRequest(), timeout=10).models[0].max_model_len == 512
    services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert {"deepinfer.v1.Gateway", "deepinfer.v1.Cluster"} <= services
