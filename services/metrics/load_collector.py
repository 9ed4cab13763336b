"""Engine load as Prometheus metrics, read from `WorkerLoad` snapshots at scrape time.

A worker exposes its own snapshot; the gateway exposes every registered worker's (the
router polls them; `registry_source`). Labels: role (prefill / decode / colocated) and worker id.
These are read, not counted: with several API processes each reports its own router's view of
every worker once, and they are never summed across processes (`multiprocess.py`).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client.core import REGISTRY, CounterMetricFamily, GaugeMetricFamily

from services.common.workers import POOL_NAMES, WorkerLoad
from services.metrics import kv_store_families

LoadSource = Callable[[], list[tuple[str, str, WorkerLoad]]]
"""Returns (role, worker id, load) per worker."""

_GAUGES = [
    ("num_requests_running", "Requests decoding or prefilling now.", lambda x: x.running_requests),
    ("num_requests_waiting", "Requests admitted and not yet scheduled.", lambda x: x.waiting_requests),
    ("kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).", lambda x: x.kv_usage),
    ("kv_cache_free_blocks", "Free KV blocks.", lambda x: x.free_blocks),
    ("total_kv_tokens", "Tokens whose KV the engine holds for live requests.", lambda x: x.total_kv_tokens),
    ("queued_prompt_tokens", "Prompt tokens admitted and not yet prefilled.", lambda x: x.queued_prompt_tokens),
    ("kv_reservations", "Decode reservations waiting for their KV.", lambda x: x.reservations),
    (
        "kv_fenced_reservations",
        "Decode reservations that ended early, their blocks fenced until no prefill engine can write them.",
        lambda x: x.fenced_reservations,
    ),  # fmt: skip
    ("encoder_queue_images", "Images waiting for a vision encoder's batch.", lambda x: x.encoder_queue_images),
    ("embedding_leases", "Embedding pool slots a vision encoder has leased.", lambda x: x.embedding_leases),
    (
        "prefix_cache_hit_rate",
        "Prompt tokens found in the prefix cache / tokens looked up.",
        lambda x: x.prefix_hits / x.prefix_queries if x.prefix_queries else 0.0,
    ),
    (
        "moe_load_imbalance",
        "Expert-parallel rank: max / mean routed tokens per rank of its instance.",
        lambda x: x.moe_load_imbalance,
    ),  # fmt: skip
]
_COUNTERS = [
    ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", lambda x: x.prefix_queries),
    ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", lambda x: x.prefix_hits),
    ("engine_kv_transfer_bytes", "KV bytes this engine wrote to decode engines.", lambda x: x.kv_transfer_bytes),
    ("handoffs", "Prefill-to-decode hand-offs (sent by a PE, received by a CE).", lambda x: x.handoffs),
    ("encoder_images", "Images a vision encoder encoded.", lambda x: x.encoder_images),
    ("encoder_cache_hits", "Images a vision encoder served from its cache.", lambda x: x.encoder_cache_hits),
    (
        "embedding_lease_renewals",
        "Embedding leases a vision encoder extended: a router's heartbeat while the request waited for its read.",
        lambda x: x.embedding_lease_renewals,
    ),  # fmt: skip
    ("spec_decode_draft_tokens", "MTP draft tokens the target model verified.", lambda x: x.spec_draft_tokens),
    ("spec_decode_accepted_tokens", "MTP draft tokens the target model accepted.", lambda x: x.spec_accepted_tokens),
    (
        "eplb_rearrangements",
        "Expert rearrangements by the expert-parallel load balancer.",
        lambda x: x.eplb_rearrangements,
    ),  # fmt: skip
    (
        "dummy_steps",
        "Steps an expert-parallel rank ran with no work, to keep its instance in lockstep.",
        lambda x: x.dummy_steps,
    ),  # fmt: skip
]

_sources: list[LoadSource] = []


class _LoadCollector:
    def collect(self):
        rows = [row for source in list(_sources) for row in source()]
        for name, doc, get in _GAUGES:
            family = GaugeMetricFamily(f"deepinfer:{name}", doc, labels=["role", "worker"])
            for role, worker, load in rows:
                family.add_metric([role, worker], float(get(load)))
            yield family
        for name, doc, get in _COUNTERS:
            family = CounterMetricFamily(f"deepinfer:{name}", doc, labels=["role", "worker"])
            for role, worker, load in rows:
                family.add_metric([role, worker], float(get(load)))
            yield family
        yield from kv_store_families.families(rows)


load_collector = _LoadCollector()
REGISTRY.register(load_collector)


def add_load_source(source: LoadSource) -> None:
    _sources.append(source)


def registry_source(registry) -> LoadSource:
    """Every worker of a router's `PoolRegistry`, with the load it last reported."""
    return lambda: [(POOL_NAMES[h.info.pool], h.worker_id, h.load) for h in list(registry.workers.values())]


def remove_load_source(source: LoadSource) -> None:
    if source in _sources:
        _sources.remove(source)
