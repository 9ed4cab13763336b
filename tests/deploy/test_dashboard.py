"""The Grafana dashboard: valid JSON Grafana can import, every panel on the chosen Prometheus, and
every metric it queries one the services export (a renamed metric must not leave a blank panel)."""

from __future__ import annotations

import json
import re

from tests.deploy.chart import ROOT

DASHBOARD = ROOT / "deploy" / "grafana-dashboard.json"
_DEFINED = re.compile(r'(Counter|Histogram|Gauge)\(\s*"(deepinfer:[a-z0-9_]+)"')
_LOAD_ENTRY = re.compile(r'\(\s*"([a-z0-9_]+)",\s*"')


def exported_metrics() -> set[str]:
    """Series names the services expose: the metric modules' definitions and the engine-load families."""
    names = set()
    for module in ("definitions.py", "autoscaler.py"):
        for kind, name in _DEFINED.findall((ROOT / "services" / "metrics" / module).read_text()):
            if kind == "Histogram":
                names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
            else:
                names.add(name if kind == "Gauge" or name.endswith("_total") else f"{name}_total")
    gauges, counters = (ROOT / "services" / "metrics" / "load_collector.py").read_text().split("_COUNTERS = [", 1)
    names |= {f"deepinfer:{n}" for n in _LOAD_ENTRY.findall(gauges.split("_GAUGES = [", 1)[1])}
    names |= {f"deepinfer:{n}_total" for n in _LOAD_ENTRY.findall(counters.split("]", 1)[0])}
    return names


def panels(dashboard: dict) -> list[dict]:
    out = []
    for panel in dashboard["panels"]:
        out += [panel] + panel.get("panels", [])
    return [p for p in out if p["type"] != "row"]


def test_the_dashboard_queries_only_exported_metrics_on_the_chosen_datasource():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["schemaVersion"] >= 36
    assert any(v["type"] == "datasource" and v["name"] == "datasource" for v in dashboard["templating"]["list"])
    exported = exported_metrics()
    assert "deepinfer:autoscaler_decisions_total" in exported and "deepinfer:kv_cache_usage_perc" in exported
    queried = set()
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in panels(dashboard):
        assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]
        for target in panel["targets"]:
            queried |= set(re.findall(r"deepinfer:[a-z0-9_]+", target["expr"]))
    assert queried <= exported, sorted(queried - exported)


def test_the_dashboard_covers_latency_throughput_queues_kv_hand_off_and_the_autoscaler():
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = " ".join(t["expr"] for p in panels(dashboard) for t in p["targets"])
    for needed in (
        "histogram_quantile(0.99, sum by (le) (rate(deepinfer:time_to_first_token_seconds_bucket",
        "deepinfer:time_per_output_token_seconds_bucket",
        "deepinfer:generation_tokens_total",
        "deepinfer:queued_prompt_tokens",
        "deepinfer:num_requests_waiting",
        "avg by (role) (deepinfer:kv_cache_usage_perc)",
        "deepinfer:kv_handoff_exposed_seconds_bucket",
        "deepinfer:autoscaler_desired_replicas",
        "deepinfer:autoscaler_decisions_total",
    ):
        assert needed in exprs, needed
