"""Heartbeats for a CE reservation while its prefill runs: the lease can be short.

A reservation is reserved with `PDConfig.renewed_lease_s` and renewed every third of it for as
long as the router waits for a PE and for its prefill: first on the CE (which says until when the
blocks are the request's), then on the PE the target went to, which may post writes until that
end and never past it. So a PE's writes always stop before the CE's lease does, however the two
messages are delayed. When the router or the PE dies, the renewals stop and the CE lets the
reservation go one lease (plus its grace) later, not after the longest prefill there may be.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Optional

from deepinfer_core.transfer.messages import KVTarget
from services.common.errors import ServiceError
from services.router.registry import WorkerHandle

logger = logging.getLogger(__name__)


class LeaseKeeper:
    def __init__(
        self,
        ce: WorkerHandle,
        sub_id: str,
        target: KVTarget,
        lease_s: float,
        writer: Callable[[], Optional[WorkerHandle]],
    ):
        """`writer`: the PE the target has gone to, None before it has."""
        self.ce, self.sub_id, self.target, self.lease_s, self.writer = ce, sub_id, target, lease_s, writer
        self.renewals = 0
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        interval = self.lease_s / 3
        while True:
            await asyncio.sleep(interval)
            try:
                expires_at = await self.ce.client.renew_lease(self.sub_id, False, self.lease_s, 0.0, interval)
            except ServiceError as e:  # the next beat tries again; the lease may lapse meanwhile
                logger.warning("could not renew the lease of %s on %s: %s", self.sub_id, self.ce.worker_id, e)
                continue
            if not expires_at:  # handed off, expired or aborted: nothing left to keep
                return
            self.renewals += 1
            self.target.expires_at = expires_at  # a prefill not sent yet carries the new end
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
