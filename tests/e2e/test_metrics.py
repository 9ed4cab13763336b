"""/metrics on the gateway and on each worker, after traffic."""

import grpc
import httpx

from deepinfer_proto import common_pb2, gateway_pb2_grpc
from tests.helpers.cluster import metric_value


def test_gateway_metrics_have_counts_after_traffic(cluster):
    for _ in range(3):
        r = httpx.post(
            f"{cluster.base_url}/completions",
            json={"prompt": "metrics", "max_tokens": 5, "ignore_eos": True},
            timeout=60,
        )
        assert r.status_code == 200
    text = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    for histogram in (
        "deepinfer:time_to_first_token_seconds",
        "deepinfer:time_per_output_token_seconds",
        "deepinfer:e2e_request_latency_seconds",
        "deepinfer:request_queue_time_seconds",
        "deepinfer:kv_transfer_seconds",
        "deepinfer:kv_handoff_exposed_seconds",
    ):
        assert metric_value(text, f"{histogram}_count") >= 3, histogram
    assert metric_value(text, "deepinfer:kv_transfer_bytes_total") > 0
    assert metric_value(text, "deepinfer:kv_handoff_exposed_seconds_sum") > 0
    assert metric_value(text, "deepinfer:router_decisions_total", pool="prefill") >= 3
    assert metric_value(text, "deepinfer:router_decisions_total", pool="decode") >= 3
    assert metric_value(text, "deepinfer:generation_tokens_total") >= 15
    assert "deepinfer:kv_cache_usage_perc{" in text and 'role="decode"' in text and 'role="prefill"' in text
    assert "deepinfer:num_requests_running{" in text and "deepinfer:num_requests_waiting{" in text
    assert "deepinfer:prefix_cache_hit_rate{" in text


def test_each_worker_exposes_its_own_metrics(cluster):
    with grpc.insecure_channel(cluster.grpc_address) as ch:
        status = gateway_pb2_grpc.ClusterStub(ch).Status(common_pb2.StatusRequest(), timeout=10)
    workers = [w for p in status.pools for w in p.workers]
    assert sorted(w.info.pool for w in workers) == [1, 2, 3]  # the embedded model has a vision tower: a VE too
    for w in workers:
        text = httpx.get(f"http://{w.info.metrics_address}/metrics", timeout=10).text
        role = {1: "encoder", 2: "prefill", 3: "decode"}[w.info.pool]
        if role == "encoder":
            assert f'deepinfer:encoder_queue_images{{role="{role}",worker="{w.info.worker_id}"}}' in text
            continue
        assert f'deepinfer:kv_cache_usage_perc{{role="{role}",worker="{w.info.worker_id}"}}' in text
        assert metric_value(text, "deepinfer:handoffs_total") >= 1
