"""Garbage collection in the serving processes.

A process that serves tokens allocates short-lived objects (deltas, chunks, protobuf messages) at
a high rate, and every so often the cyclic collector's oldest generation walks every tracked object
in the process, start-up's included: the modules, the tokenizer, the app, the configs, which
never become garbage. Measured on the head's per-token path, collection doubled the router's cost
at 1,024 streams. `gc.freeze()` once start-up is over moves those objects out of the collector's
sight, so each full collection walks only what serving allocated since.

What serving allocates still lives long enough to be walked many times: each open request holds
~170 tracked objects (its tasks, coroutines, async generators, bound callbacks), ~175k at 1,024
streams. At the interpreter's default thresholds (700, 10, 10) the young collection runs every 700
net allocations and promotes each request's objects into the middle and oldest generations, whose
walks then cost 5 and ~80 ms apiece: 12-15% of the head's CPU with 64-token requests at 1,024
streams. Serving thresholds let a collection run a fraction as often; the objects counted are net
(allocations less frees), so what reference counting frees at once, nearly everything, costs
nothing, and the cyclic garbage left between collections is a few MB at most.
"""

from __future__ import annotations

import gc

SERVING_THRESHOLDS = (50_000, 20, 10)
"""Young generation: a collection every 50,000 net container allocations (a few hundred requests'
worth); middle: every 20 young collections; oldest: every 10 middle ones, and, as always, only
once what awaits it exceeds a quarter of what it holds."""


def freeze_startup_heap() -> None:
    """Collect what start-up left behind, freeze the rest, and set the serving thresholds (call
    once, when serving starts)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*SERVING_THRESHOLDS)
