"""The KV store's metrics, per worker and tier, from `WorkerLoad` snapshots (`load_collector.py`).

Tiers: l2, an engine's host-memory pool; l3, the store's entry files (shared by every engine on the
directory, so each engine reports the same l3 bytes as it last saw them). Hit and miss tokens are
prompt tokens a PE looked up past its own prefix cache.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

from services.common.workers import WorkerLoad

Rows = Iterable[tuple[str, str, WorkerLoad]]

_TIERED = [
    (CounterMetricFamily, "kv_store_hit_tokens", "Prompt tokens loaded from the KV store, by tier.", "hit_tokens"),
    (GaugeMetricFamily, "kv_store_bytes", "Bytes held in each KV store tier now.", "bytes"),
    (GaugeMetricFamily, "kv_store_capacity_bytes", "Byte limit of each KV store tier.", "capacity_bytes"),
    (CounterMetricFamily, "kv_store_evictions", "KV store entries evicted to make room, by tier.", "evictions"),
    (CounterMetricFamily, "kv_store_load_bytes", "Bytes loaded from each KV store tier.", "load_bytes"),
]
_FLAT = [
    ("kv_store_miss_tokens", "Prompt tokens looked up in the KV store and computed.", "kv_store_miss_tokens"),
    ("kv_store_corrupt", "KV store entries that failed their checks and were dropped.", "kv_store_corrupt_entries"),
    (
        "kv_store_load_failures",
        "KV store loads dropped (I/O error, gone, late) and recomputed.",
        "kv_store_load_failures",
    ),
    ("kv_store_saved_bytes", "Bytes a decode engine wrote to the KV store's files.", "kv_store_saved_bytes"),
    ("local_prefills", "Prompts a decode engine prefilled itself (short uncached part).", "local_prefills"),
]


def _tier_value(load: WorkerLoad, what: str, tier: str) -> float:
    if what == "bytes":
        return float(getattr(load, f"kv_store_{tier}_bytes"))
    if what == "capacity_bytes":
        return float(getattr(load, f"kv_store_{tier}_capacity_bytes"))
    return float(getattr(load, f"kv_store_{what}_{tier}"))


def families(rows: Rows) -> Iterator:
    rows = list(rows)
    for kind, name, doc, what in _TIERED:
        family = kind(f"deepinfer:{name}", doc, labels=["role", "worker", "tier"])
        for role, worker, load in rows:
            for tier in ("l2", "l3"):
                family.add_metric([role, worker, tier], _tier_value(load, what, tier))
        yield family
    for name, doc, attr in _FLAT:
        family = CounterMetricFamily(f"deepinfer:{name}", doc, labels=["role", "worker"])
        for role, worker, load in rows:
            family.add_metric([role, worker], float(getattr(load, attr)))
        yield family
    summary = SummaryMetricFamily(
        "deepinfer:kv_store_load_seconds",
        "Admission to the stored prefix in the KV cache, per load that placed a block.",
        labels=["role", "worker"],
    )
    for role, worker, load in rows:
        summary.add_metric([role, worker], count_value=load.kv_store_loads, sum_value=load.kv_store_load_seconds)
    yield summary
