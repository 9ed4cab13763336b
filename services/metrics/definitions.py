"""Every metric of the cluster, defined once per process (prometheus-client's default registry).

Request-level histograms are observed where the request is seen whole (the gateway); stage
latencies where the stage is (router: KV transfer, queue); engine load is read from
`WorkerLoad` snapshots by `load_collector.py` on each scrape. With several API processes
(`multiprocess.py`) each metric here is summed over the processes: a Gauge added here needs the
`multiprocess_mode` that says how to combine it.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)
_TPOT_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    1.0,
    2.5,
)

TIME_TO_FIRST_TOKEN = Histogram(
    "deepinfer:time_to_first_token_seconds",
    "Arrival at the gateway to the first output token.",
    ["model_name"],
    buckets=_LATENCY_BUCKETS,
)
TIME_PER_OUTPUT_TOKEN = Histogram(
    "deepinfer:time_per_output_token_seconds",
    "Mean time between output tokens of a request, after the first.",
    ["model_name"],
    buckets=_TPOT_BUCKETS,
)
E2E_LATENCY = Histogram(
    "deepinfer:e2e_request_latency_seconds",
    "Arrival at the gateway to the last output token.",
    ["model_name"],
    buckets=_LATENCY_BUCKETS,
)
QUEUE_TIME = Histogram(
    "deepinfer:request_queue_time_seconds",
    "Time a request waited before its prefill started (router admission + prefill engine queue).",
    ["model_name"],
    buckets=_LATENCY_BUCKETS,
)
REQUEST_SUCCESS = Counter(
    "deepinfer:request_success_total", "Requests finished, by finish reason.", ["model_name", "finished_reason"]
)
REQUEST_ERRORS = Counter("deepinfer:request_errors_total", "Requests that ended with an error, by code.", ["code"])
PROMPT_TOKENS = Counter("deepinfer:prompt_tokens_total", "Prompt tokens of finished requests.", ["model_name"])
GENERATION_TOKENS = Counter("deepinfer:generation_tokens_total", "Output tokens of finished requests.", ["model_name"])

ROUTER_DECISIONS = Counter(
    "deepinfer:router_decisions_total", "Requests the router sent to each worker.", ["pool", "worker"]
)
ROUTER_RETRIES = Counter("deepinfer:router_retries_total", "Prefills retried on another worker.", ["reason"])
KV_TRANSFER_SECONDS = Histogram(
    "deepinfer:kv_transfer_seconds",
    "First post (an early chunk's, when streamed) to completion of one request's last KV write, prefill to decode.",
    ["worker"],
    buckets=_LATENCY_BUCKETS,
)
KV_HANDOFF_EXPOSED_SECONDS = Histogram(
    "deepinfer:kv_handoff_exposed_seconds",
    "End of a request's prefill forward to its KV being in the decode engine: what the hand-off adds to TTFT.",
    ["worker"],
    buckets=_LATENCY_BUCKETS,
)
EMBEDDING_TRANSFER_SECONDS = Histogram(
    "deepinfer:embedding_transfer_seconds",
    "A prefill engine's NIXL READ of one request's image embeddings from a vision encoder.",
    ["worker"],
    buckets=_LATENCY_BUCKETS,
)
KV_TRANSFER_BYTES = Counter("deepinfer:kv_transfer_bytes_total", "KV bytes written prefill to decode.", ["worker"])

API_PROCESS_REQUESTS = Counter(
    "deepinfer:api_process_requests_total",
    "Requests each API process (0 = the head; `--api-workers`) admitted, or refused at the concurrency limit.",
    ["process", "outcome"],
)

WORKER_RESTARTS = Counter(
    "deepinfer:worker_restarts_total", "Engines the controller started to replace one that died.", ["pool"]
)
LEASE_RENEWALS = Counter(
    "deepinfer:lease_renewals_total",
    "Leases the router renewed for a request still waiting (a CE reservation, a vision encoder's embeddings), by stage.",
    ["stage"],
)
FENCES_LIFTED = Counter(
    "deepinfer:kv_fences_lifted_total",
    "Fenced decode reservations freed before their lease ended: the prefill engine that could write them died.",
)
MIGRATIONS = Counter(
    "deepinfer:migrations_total",
    "Requests moved to a healthy prefill/decode pair mid-stream (prompt + tokens so far re-prefilled), by reason.",
    ["reason"],
)

_CHILDREN: dict = {}


def labelled(metric, *values: str):
    """`metric.labels(*values)`, looked up once per label values: `labels` checks its arguments and
    takes a lock on every call, and the head calls it several times a request."""
    key = (metric, values)
    child = _CHILDREN.get(key)
    if child is None:
        child = _CHILDREN[key] = metric.labels(*values)
    return child
