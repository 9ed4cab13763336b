"""`deepinfer bench` against real `deepinfer serve` clusters on the embedded model."""

import json
import os

import pytest

from services.cli.main import main
from tests.helpers.cluster import SMALL_ENGINE, ServeProcess

# field names shared with `vllm bench serve`'s result JSON
VLLM_FIELDS = [
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    "max_concurrent_requests",
    "input_lens",
    "output_lens",
    "ttfts",
    "itls",
    "errors",
    "generated_texts",
] + [f"{stat}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "std", "p90", "p99")]

LOAD = ["--random-input-len", "24", "--random-output-len", "6", "--ignore-eos", "--disable-tqdm"]


@pytest.fixture(scope="module")
def cluster():
    with pytest.MonkeyPatch.context() as env:
        if not os.environ.get("RAY_ADDRESS"):
            env.setenv("RAY_ADDRESS", "local")  # a Ray of its own, whatever else runs on the machine
        serve = ServeProcess(*SMALL_ENGINE)
    yield serve
    serve.stop()


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_bench_serve_writes_the_result_json(cluster, tmp_path, endpoint):
    args = ["bench", "serve", "--base-url", cluster.url, "--endpoint", endpoint, "--num-prompts", "6", *LOAD]
    args += ["--max-concurrency", "3", "--num-warmups", "2", "--goodput", "ttft:60000", "tpot:60000"]
    assert main([*args, "--result-filename", "r.json", "--result-dir", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "r.json").read_text())
    assert [f for f in VLLM_FIELDS if f not in r] == []
    assert (r["completed"], r["failed"], r["model_id"]) == (6, 0, "deepinfer-tiny")
    assert r["output_lens"] == [6] * 6 and r["total_output_tokens"] == 36  # usage counts, EOS ignored
    assert 1 <= r["max_concurrent_requests"] <= 3
    assert r["request_goodput"] == pytest.approx(r["request_throughput"])
    assert all(len(gaps) >= 1 for gaps in r["itls"]) and r["errors"] == [""] * 6
    assert 0 < r["median_ttft_ms"] < r["median_e2el_ms"] and r["mean_tpot_ms"] > 0
    if endpoint == "/v1/completions":
        assert r["input_lens"] == [24] * 6  # the server's count of the exact-length prompts


def test_sweep_of_one_configuration_draws_the_charts(tmp_path):
    out = tmp_path / "sweep"
    args = ["bench", "sweep", "--configs", "colocated", "--request-rates", "4,8", "--num-prompts", "6", *LOAD]
    args += ["--serve-args", " ".join(SMALL_ENGINE), "--output-dir", str(out), "--goodput", "ttft:60000", "tpot:60000"]
    assert main(args) == 0
    for name in ("latency_cdf.png", "latency_vs_rate.png", "goodput_vs_rate.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    report = (out / "report.md").read_text()
    assert "| colocated | `--colocated --decode 1` | 8 |" in report  # every request met the loose SLOs
    assert "| colocated | 4 | 6 | 0 |" in report and "| colocated | 8 | 6 | 0 |" in report
    run = json.loads((out / "runs" / "colocated-rate8.json").read_text())
    assert (run["request_rate"], run["completed"], run["label"]) == (8.0, 6, "colocated")
    assert json.loads((out / "summary.json").read_text())["configs"][0]["goodput"] == 8.0
