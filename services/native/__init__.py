"""Compiled parts of the service layer, each beside the Python it stands in for.

`delta_lane` (`delta_lane.c`, built by `pip install`; see `setup.py`):
- on the router, a worker subscription's `DeltaBatch` read from its wire bytes, with the ordinary
  mid-stream deltas of streamed SSE requests written to their connections in compiled code, and
  those of streamed gRPC requests made into their `GenerateResponse` bytes for the handler
  (`services/common/fast_lane.py` says when);
- on a worker, each engine turn's deltas encoded as a `DeltaBatch`'s wire bytes (`encode_batch`).

Where it was not built (no C compiler at install), or with `DEEPINFER_NATIVE_LANE=0`, the Python
it stands in for runs: `dispatch` is the Python loop, every delta takes the Python lane or the
chain, and `encode_batch` is None (`messages.batch_message` fills the message in Python). Same
bytes, more CPU.
"""

from __future__ import annotations

import os

from deepinfer_proto import common_pb2, worker_pb2


def _load():
    if os.environ.get("DEEPINFER_NATIVE_LANE", "1") == "0":
        return None
    try:
        from services.native import _delta_lane
    except ImportError:
        return None
    return _delta_lane


delta_lane = _load()
NativeLane = delta_lane.NativeLane if delta_lane is not None else None
"""One request's native lane (None: not built, or switched off)."""

_sample_delta = common_pb2.SampleDelta.FromString
_delta_batch = worker_pb2.DeltaBatch.FromString


def _dispatch_python(batch: bytes, inboxes: dict) -> None:
    for item in _delta_batch(batch).items:
        inbox = inboxes.get(item.request_id)
        if inbox is not None:  # None: a request the router has let go (aborted, deadline)
            inbox.put(item.delta)


def _dispatch_native(batch: bytes, inboxes: dict) -> None:
    delta_lane.dispatch(batch, inboxes, _sample_delta)


dispatch = _dispatch_native if delta_lane is not None else _dispatch_python
"""dispatch(batch, inboxes): each item of a `DeltaBatch`'s wire bytes to its request's native lane
or, through `inbox.put`, to its inbox (request id -> `RequestInbox`)."""


encode_batch = delta_lane.encode_batch if delta_lane is not None else None
"""encode_batch(items): (request id, SampleDelta) pairs as a `DeltaBatch`'s wire bytes, or None
for a turn it leaves to the Python encoder (logprobs, a value the message cannot hold)."""


def lanes_taken() -> int:
    """Deltas the native lanes of this process took."""
    return delta_lane.taken() if delta_lane is not None else 0
