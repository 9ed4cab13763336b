"""Heartbeats for a lease held for a request that waits: the lease can be short.

Two holders: a CE's reservation (reserved with `PDConfig.renewed_lease_s` and renewed while the
router waits for a PE and for its prefill), and a vision encoder's leases on a request's image
embeddings (asked for with the same lease, renewed from the encode until the PE's prefill call
ends: the read is its first step). Every third of the lease the holder is asked for another lease
from now; it says until when it holds the request's state, and that end goes into what the router
has not sent yet (`renewed`: the KV target, the embedding handles). For a reservation the PE the
target went to (`writer`) is told the end too: it may post writes until then and never past it,
so its writes always stop before the CE's lease does, however the two messages are delayed. When
the router dies, the renewals stop and the holder lets the state go one lease (plus its grace)
later, not after the longest wait there may be; when the holder answers that it holds nothing
(read, handed off, expired, aborted), the beats end.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Optional

from services.common.errors import ServiceError
from services.metrics import definitions as m
from services.router.registry import WorkerHandle

logger = logging.getLogger(__name__)


class LeaseKeeper:
    def __init__(
        self,
        holder: WorkerHandle,
        sub_id: str,
        lease_s: float,
        renewed: Callable[[float], None],
        writer: Callable[[], Optional[WorkerHandle]] = lambda: None,
    ):
        """`holder`: the CE or VE that holds the lease; `renewed(expires_at)`: the new end, for what
        is still to be sent; `writer`: the PE the CE's KV target has gone to, None before it has
        (and for a VE's leases)."""
        self.holder, self.sub_id, self.lease_s = holder, sub_id, lease_s
        self.renewed, self.writer = renewed, writer
        self.renewals = 0
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        interval = self.lease_s / 3
        stage = self.holder.info.pool_name
        while True:
            await asyncio.sleep(interval)
            try:
                expires_at = await self.holder.client.renew_lease(self.sub_id, False, self.lease_s, 0.0, interval)
            except ServiceError as e:  # the next beat tries again; the lease may lapse meanwhile
                logger.warning("could not renew the lease of %s on %s: %s", self.sub_id, self.holder.worker_id, e)
                continue
            if not expires_at:  # read, handed off, expired or aborted: nothing left to keep
                return
            self.renewals += 1
            m.LEASE_RENEWALS.labels(stage).inc()
            self.renewed(expires_at)
            pe = self.writer()
            if pe is None:
                continue
            try:
                await pe.client.renew_lease(self.sub_id, True, 0.0, expires_at, interval)
            except ServiceError as e:  # its writes stop at the end it knows: still safe
                logger.warning("could not tell %s the lease of %s: %s", pe.worker_id, self.sub_id, e)

    def stop(self) -> None:
        """No more beats (a renewal in flight is cancelled: the caller may be cancelled itself)."""
        self._task.cancel()


def target_renewer(target) -> Callable[[float], None]:
    """For a CE reservation: a prefill not sent yet carries the reservation's new end
    (`target`: its `KVTarget`)."""

    def renewed(expires_at: float) -> None:
        target.expires_at = expires_at

    return renewed
