"""Metrics from synthetic request records whose answers are known."""

import math

import pytest

from services.bench.metrics import (
    Selection,
    compute_metrics,
    latency_stats,
    max_concurrent,
    meets_slos,
    parse_selection,
    parse_slos,
    percentile_label,
    slo_attainment,
)
from services.bench.records import RequestRecord


def record(start=0.0, ttft=0.1, itl=(0.02, 0.03), tokens=None, ok=True, prompt_len=10) -> RequestRecord:
    itl = list(itl)
    r = RequestRecord(prompt_len=prompt_len, start=start, ttft=ttft, itl=itl, success=ok)
    r.output_tokens = len(itl) + 1 if tokens is None else tokens
    r.end = start + ttft + sum(itl)
    r.error = "" if ok else "HTTP 500: boom"
    return r


def test_latency_stats_mean_median_std_and_interpolated_percentiles():
    stats = latency_stats("ttft", [0.1, 0.2, 0.3, 0.4], (90.0, 99.9))
    assert stats["mean_ttft_ms"] == pytest.approx(250.0)
    assert stats["median_ttft_ms"] == pytest.approx(250.0)
    assert stats["std_ttft_ms"] == pytest.approx(math.sqrt(12500.0))  # population std
    assert stats["p90_ttft_ms"] == pytest.approx(370.0)  # 300 + 0.7 * 100
    assert stats["p99.9_ttft_ms"] == pytest.approx(300 + 0.997 * 100)
    assert latency_stats("itl", [], (99.0,)) == {"mean_itl_ms": 0, "median_itl_ms": 0, "std_itl_ms": 0, "p99_itl_ms": 0}


def test_tpot_uses_output_tokens_and_itl_never_holds_the_first_token():
    # 3 chunks (2 gaps) but the server's usage says 5 tokens: TPOT = (e2e - ttft) / 4, ITL = the 2 gaps
    r = record(ttft=0.5, itl=(0.1, 0.3), tokens=5)
    m = compute_metrics([r], duration=1.0, selection=Selection(), slos={})
    assert m["mean_tpot_ms"] == pytest.approx(400.0 / 4)
    assert m["mean_itl_ms"] == pytest.approx(200.0)
    assert m["mean_ttft_ms"] == pytest.approx(500.0)
    assert m["mean_e2el_ms"] == pytest.approx(900.0)


def test_a_request_with_one_output_token_has_no_tpot_and_passes_a_tpot_slo():
    one = record(ttft=0.2, itl=(), tokens=1)
    two = record(ttft=0.1, itl=(0.05,), tokens=2)
    m = compute_metrics([one, two], duration=2.0, selection=Selection(), slos={"tpot": 10.0})
    assert one.tpot is None
    assert m["mean_tpot_ms"] == pytest.approx(50.0)  # only the two-token request
    assert m["mean_ttft_ms"] == pytest.approx(150.0)  # both
    assert meets_slos(one, {"tpot": 10.0})
    assert m["request_goodput"] == pytest.approx(0.5)  # `one` is good, `two` (TPOT 50 ms) is not


def test_goodput_needs_every_slo_and_ignores_failures():
    fast = record(ttft=0.05, itl=(0.01, 0.01))
    slow_start = record(ttft=0.5, itl=(0.01, 0.01))
    slow_tokens = record(ttft=0.05, itl=(0.2, 0.2))
    failed = record(ttft=0.01, itl=(), ok=False)
    records = [fast, slow_start, slow_tokens, failed]
    slos = {"ttft": 100.0, "tpot": 50.0}
    m = compute_metrics(records, duration=4.0, selection=Selection(), slos=slos)
    assert m["completed"] == 3 and m["failed"] == 1
    assert m["request_goodput"] == pytest.approx(1 / 4.0)
    assert slo_attainment(records, slos, num_sent=4) == pytest.approx(0.25)
    assert compute_metrics(records, 4.0, Selection(), {})["request_goodput"] is None
    assert meets_slos(fast, {"e2el": 80.0}) and not meets_slos(fast, {"e2el": 60.0})


def test_throughputs_count_successful_requests_only():
    records = [record(prompt_len=10), record(prompt_len=20), record(ok=False, prompt_len=99)]
    m = compute_metrics(records, duration=2.0, selection=Selection(), slos={})
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (30, 6)
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(3.0)
    assert m["total_token_throughput"] == pytest.approx(18.0)


def test_max_concurrent_requests_counts_overlaps_not_touching_intervals():
    def span(start, end):
        r = RequestRecord(prompt_len=1, start=start)
        r.end = end
        return r

    assert max_concurrent([span(0, 1), span(0.5, 1.5), span(1.2, 2)]) == 2
    assert max_concurrent([span(0, 1), span(1, 2), span(2, 3)]) == 1
    assert max_concurrent([span(0, 5), span(1, 2), span(1.5, 3)]) == 3


def test_selection_limits_the_fields_and_names_percentiles_as_vllm_does():
    selection = parse_selection("ttft,itl", "50,99.9")
    m = compute_metrics([record()], 1.0, selection, {})
    assert "p50_ttft_ms" in m and "p99.9_itl_ms" in m and "mean_tpot_ms" not in m
    assert percentile_label(99) == "p99" and percentile_label(99.5) == "p99.5"
    for metrics, percentiles in (("ttft,xyz", "99"), ("ttft", "0"), ("ttft", "a")):
        with pytest.raises(ValueError):
            parse_selection(metrics, percentiles)


def test_parse_slos():
    assert parse_slos(["ttft:500", "tpot:50", "e2el:2000"]) == {"ttft": 500.0, "tpot": 50.0, "e2el": 2000.0}
    for bad in (["itl:5"], ["ttft"], ["ttft:fast"], ["tpot:-1"]):
        with pytest.raises(ValueError):
            parse_slos(bad)
