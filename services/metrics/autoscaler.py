"""The planner's metrics: the pool sizes it wants and the decisions it took.

Set in the head process only (the controller runs there). With several API processes
(`multiprocess.py`) the gauge is combined with `max`: one process writes it, the others have no
series of it, so the head's value is the one scraped from any process.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

AUTOSCALER_DESIRED_REPLICAS = Gauge(
    "deepinfer:autoscaler_desired_replicas",
    "Engines the controller wants in each pool (start values, `deepinfer scale`, or its autoscaling policy).",
    ["pool"],
    multiprocess_mode="max",
)
AUTOSCALER_DECISIONS = Counter(
    "deepinfer:autoscaler_decisions_total",
    "Pool size changes the autoscaling policy decided, by direction (up / down).",
    ["pool", "direction"],
)
AUTOSCALER_UNPLACED = Gauge(
    "deepinfer:autoscaler_unplaced_engines",
    "Engines of each pool waiting for a node that offers the pool's Ray resource.",
    ["pool"],
    multiprocess_mode="max",
)
