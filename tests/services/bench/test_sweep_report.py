"""Sweep pieces without a cluster: configuration names, the goodput rule, the report and its plots."""

import pytest

from services.bench.datasets import DatasetOptions
from services.bench.driver import Load, RunOutcome, Target
from services.bench.metrics import Selection
from services.bench.records import RequestRecord
from services.bench.result import build_result
from services.bench.serve import ServeBench
from services.bench.sweep.configs import parse_configs
from services.bench.sweep.report import write_report
from services.bench.sweep.runner import ConfigSweep, SweepPlan, SweepPoint, goodput

SLOS = {"ttft": 100.0, "tpot": 20.0}


def test_configuration_names():
    configs = parse_configs("colocated,1p1d,2P1D,colocated2,1p1d-cond,1p2d-nostore")
    pure = ("--local-prefill-tokens", "0")
    assert [c.serve_args for c in configs] == [
        ("--colocated", "--decode", "1"),
        ("--prefill", "1", "--decode", "1", *pure),
        ("--prefill", "2", "--decode", "1", *pure),
        ("--colocated", "--decode", "2"),
        ("--prefill", "1", "--decode", "1"),
        ("--prefill", "1", "--decode", "2", *pure, "--no-kv-store"),
    ]
    for bad in ("pd", "0p1d", "1p1d,1p1d", "", "1p1d-fast"):
        with pytest.raises(ValueError):
            parse_configs(bad)


def synthetic_point(rate: float, slow_fraction: float, n: int = 20) -> SweepPoint:
    """n requests at `rate`; the first `slow_fraction` of them miss the TTFT SLO."""
    records = []
    for i in range(n):
        ttft = 0.3 if i < slow_fraction * n else 0.02 + 0.001 * i
        r = RequestRecord(prompt_len=8, start=i / rate, ttft=ttft, itl=[0.01] * 3, output_tokens=4, success=True)
        r.end = r.start + ttft + 0.03
        records.append(r)
    outcome = RunOutcome(records, duration=n / rate)
    result = build_result(
        Target("http://x", "m"), Load(request_rate=rate), Selection(), SLOS, outcome, {"num_prompts": n}
    )
    return SweepPoint(rate, 1 - slow_fraction, result)


def test_goodput_is_the_highest_rate_with_every_lower_rate_passing_too():
    sweep = ConfigSweep(parse_configs("1p1d")[0])
    sweep.points = [synthetic_point(1, 0.0), synthetic_point(2, 0.05), synthetic_point(4, 0.5), synthetic_point(8, 0.0)]
    assert goodput(sweep, 0.9) == 2  # 8 passes by chance, but 4 did not
    assert goodput(sweep, 0.99) == 1
    sweep.points[0] = synthetic_point(1, 0.2)
    assert goodput(sweep, 0.9) is None


def test_report_has_the_tables_and_three_png_charts(tmp_path):
    pytest.importorskip("matplotlib")
    bench = ServeBench(Target("", ""), DatasetOptions("random", 20), slos=SLOS)
    plan = SweepPlan(parse_configs("colocated,1p1d"), [1.0, 2.0], bench, str(tmp_path))
    colocated, pd = (ConfigSweep(c) for c in plan.configs)
    colocated.points = [synthetic_point(1, 0.0), synthetic_point(2, 0.3)]
    pd.points = [synthetic_point(1, 0.0), synthetic_point(2, 0.05)]
    paths = write_report(plan, [colocated, pd])
    names = sorted(p.rsplit("/", 1)[-1] for p in paths)
    assert names == ["goodput_vs_rate.png", "latency_cdf.png", "latency_vs_rate.png", "report.md", "summary.json"]
    for png in tmp_path.glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    report = (tmp_path / "report.md").read_text()
    assert "| colocated | `--colocated --decode 1` | 1 |" in report
    assert "| 1p1d | `--prefill 1 --decode 1 --local-prefill-tokens 0` | 2 |" in report
    assert report.count("| colocated | 1 | 20 | 0 |") == 1 and "70%" in report and "95%" in report
