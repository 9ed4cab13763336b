"""The wire format: the EngineType enum matches Python, and the generated modules are current."""

import dataclasses
import subprocess
import sys
from pathlib import Path

from google.protobuf import descriptor_pb2

from deepinfer_core.roles import EngineType
from deepinfer_proto import (
    common_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)

ROOT = Path(__file__).resolve().parents[2]
MODULES = {"common": common_pb2, "worker": worker_pb2, "router": router_pb2, "gateway": gateway_pb2}
GRPC_MODULES = {"worker": worker_pb2_grpc, "router": router_pb2_grpc, "gateway": gateway_pb2_grpc}


def test_engine_type_values_are_identical_in_python_and_proto():
    proto_values = {v.name: v.number for v in common_pb2.DESCRIPTOR.enum_types_by_name["EngineType"].values}
    assert proto_values == {member.name: member.value for member in EngineType}


def test_worker_info_carries_the_python_value():
    from services.common.messages import info_from_proto, info_to_proto
    from services.common.workers import POOL_DECODE, WorkerInfo

    info = WorkerInfo("w", POOL_DECODE, EngineType.COMPLETION.value, "127.0.0.1:1")
    msg = info_to_proto(info)
    assert msg.engine_type == common_pb2.COMPLETION == EngineType.COMPLETION.value
    assert EngineType(info_from_proto(msg).engine_type) is EngineType.COMPLETION


def test_worker_info_and_connect_peer_carry_the_ce_kv_region():
    from deepinfer_core.transfer.messages import KVRegion
    from deepinfer_proto import worker_pb2
    from services.common.messages import info_from_proto, info_to_proto, region_from_proto, region_to_proto
    from services.common.workers import POOL_DECODE, WorkerInfo

    region = KVRegion(2**47 + 4096, 1_000_000, 3, "VRAM", "f" * 20, "Llama bfloat16")
    info = WorkerInfo("ce", POOL_DECODE, EngineType.COMPLETION.value, "h:1", agent_name="a", kv_region=region)
    assert info_from_proto(common_pb2.WorkerInfo.FromString(info_to_proto(info).SerializeToString())) == info
    req = worker_pb2.ConnectPeerRequest(agent_name="a", region=region_to_proto(region))
    assert region_from_proto(worker_pb2.ConnectPeerRequest.FromString(req.SerializeToString()), "region") == region
    # an older worker or router leaves the region out: None, and the first hand-off prepares it
    assert info_from_proto(info_to_proto(dataclasses.replace(info, kv_region=None))).kv_region is None
    assert region_from_proto(worker_pb2.ConnectPeerRequest(agent_name="a"), "region") is None


def test_generated_modules_match_the_proto_files(tmp_path):
    """Fails when a .proto changed without `make proto`."""
    out = tmp_path / "set.pb"
    protos = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "deepinfer_proto").glob("*.proto"))
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I", ".", f"--descriptor_set_out={out}", *protos],
        cwd=ROOT,
        check=True,
    )
    fresh = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    by_name = {f.name: _without_json_names(f) for f in fresh.file}
    assert set(by_name) == {f"deepinfer_proto/{name}.proto" for name in MODULES}
    for name, module in MODULES.items():
        generated = _without_json_names(descriptor_pb2.FileDescriptorProto.FromString(module.DESCRIPTOR.serialized_pb))
        assert generated == by_name[f"deepinfer_proto/{name}.proto"], (
            f"deepinfer_proto/{name}_pb2.py is stale: run `make proto`"
        )
    for name, module in GRPC_MODULES.items():
        for service in by_name[f"deepinfer_proto/{name}.proto"].service:
            servicer = getattr(module, f"{service.name}Servicer")
            missing = [m.name for m in service.method if not hasattr(servicer, m.name)]
            assert not missing, (
                f"deepinfer_proto/{name}_pb2_grpc.py is stale ({service.name} lacks {missing}): run `make proto`"
            )


def _without_json_names(f: descriptor_pb2.FileDescriptorProto) -> descriptor_pb2.FileDescriptorProto:
    """protoc fills json_name in descriptor sets, not in generated modules."""

    def strip(messages):
        for m in messages:
            for field in m.field:
                field.ClearField("json_name")
            strip(m.nested_type)

    strip(f.message_type)
    return f


def test_sampling_params_round_trip_keeps_defaults_and_values():
    from deepinfer_core.sampling_params import SamplingParams
    from services.common.params import params_from_proto, params_to_proto

    assert params_from_proto(common_pb2.SamplingParams()) == SamplingParams()
    p = SamplingParams(
        n=3, temperature=0.0, top_k=5, seed=9, stop=["x"], stop_token_ids=[4], max_tokens=None, logprobs=2
    )
    assert params_from_proto(params_to_proto(p)) == p
    assert params_from_proto(params_to_proto(SamplingParams(max_tokens=None))).max_tokens is None
