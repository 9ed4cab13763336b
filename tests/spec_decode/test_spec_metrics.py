"""Speculative decoding counters from a real engine's load, through the worker's proto, to the
Prometheus text every worker and the gateway serve, and to `deepinfer status`'s lines."""

from __future__ import annotations

import dataclasses

import pytest
from prometheus_client import generate_latest

from deepinfer_proto import common_pb2
from services.cli.admin import format_status
from services.common.messages import load_from_proto, load_to_proto
from services.common.workers import WorkerLoad
from services.metrics.load_collector import add_load_source, remove_load_source
from tests.helpers.cluster import metric_value
from tests.helpers.engines import greedy, make_engine, run_to_completion
from tests.helpers.spec import role_environment


@pytest.fixture(scope="module")
def load() -> WorkerLoad:
    with role_environment():
        engine = make_engine(num_speculative_tokens=2)
        engine.add_request("r", params=greedy(12), prompt_token_ids=[400 + i for i in range(10)])
        run_to_completion(engine)
        return WorkerLoad(worker_id="decode-0", **dataclasses.asdict(engine.load()))


def test_counters_cross_the_proto(load):
    assert load.spec_draft_tokens > 0 and len(load.spec_proposed_per_position) == 2
    back = load_from_proto(load_to_proto(load))
    assert back == load


def test_metrics_text_has_the_spec_counters(load):
    source = lambda: [("decode", "decode-0", load)]  # noqa: E731
    add_load_source(source)
    try:
        text = generate_latest().decode()
    finally:
        remove_load_source(source)
    assert metric_value(text, "deepinfer:spec_decode_draft_tokens_total") == load.spec_draft_tokens
    assert metric_value(text, "deepinfer:spec_decode_accepted_tokens_total") == load.spec_accepted_tokens


def test_status_shows_acceptance_per_position(load):
    status = common_pb2.ClusterStatus(
        pools=[
            common_pb2.PoolStatus(
                pool=common_pb2.POOL_DECODE,
                target=1,
                workers=[common_pb2.WorkerStatus(info=common_pb2.WorkerInfo(worker_id="decode-0"),
                                                 load=load_to_proto(load), state="ready")],
            )
        ]
    )  # fmt: skip
    text = format_status(status)
    assert "mtp acceptance" in text and f"of {load.spec_draft_tokens} drafts (1:" in text and " 2:" in text


def test_serve_flag_reaches_the_engine_args():
    import argparse

    from deepinfer_core.roles import EngineType
    from services.cli import serve

    parser = argparse.ArgumentParser()
    parser.add_argument("--log-level", default="WARNING")  # the top-level flag `deepinfer` adds
    serve.add_parser(parser.add_subparsers())
    chosen = serve.config_from_args(parser.parse_args(["serve", "--device", "cpu", "--num-speculative-tokens", "2"]))
    default = serve.config_from_args(parser.parse_args(["serve", "--device", "cpu"]))
    assert default.engine_args.num_speculative_tokens is None  # DEEPINFER_USE_NEXTN_DECODE decides
    with role_environment():
        assert chosen.engine_args.to_engine_args(EngineType.COMPLETION).nextn == 2
