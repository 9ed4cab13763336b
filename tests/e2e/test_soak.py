"""A short soak (64 streams for 20 s against the shared 1 PE + 1 CE cluster): no request is lost,
every stage is at rest afterwards, and each process's resident memory is reported with its slope
(`benchmarks/soak.py` runs the long one)."""

from benchmarks.soak import soak
from tests.helpers.faults import wait_at_rest

STREAMS, SECONDS = 64, 20.0


def test_a_short_soak_loses_nothing_and_reports_memory(cluster):
    result = soak(cluster.url, cluster.grpc_address, STREAMS, SECONDS, max_tokens=24, head_pid=cluster.proc.pid)
    print(f"\n{result.requests} requests, {len(result.lost)} lost\n{result.table(warmup_s=SECONDS / 2)}")
    assert result.requests >= STREAMS and result.lost == [], result.lost[:5]
    assert {"head"} < set(result.rss_mb) and all(len(s) >= 3 for s in result.rss_mb.values())
    view = wait_at_rest(cluster, timeout_s=60)
    assert all(v == (0, 0, 0, 0, 0) for v in view.values()), view
