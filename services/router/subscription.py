"""One router's subscription to one streaming worker (CE or NORMAL): a `Decode.Subscribe` call
whose `DeltaBatch`es, one per engine turn, are dispatched to the inboxes of their requests.

The call's messages are read as wire bytes (`subscribe_raw`) and handed whole to
`services.native.dispatch`, which parses them in compiled code where it is built: a streamed SSE
request's ordinary deltas are written to its connection there, the rest go to `inbox.put`.

A subscription that breaks (the worker died, the connection dropped, the worker ended it)
fails every inbox it feeds with UNAVAILABLE naming the worker; the client opens a new one,
under a new subscriber id, for later requests.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import uuid
from typing import Optional

import grpc

from deepinfer_proto import worker_pb2
from services.common.errors import ErrorCode, ServiceError
from services.common.grpc_util import CALL_ERRORS, error_from_rpc, method_path
from services.native import dispatch
from services.router.inbox import RequestInbox

logger = logging.getLogger(__name__)

_ROUTER_ID = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
"""This router process, in every subscriber id it hands out."""
_SUBSCRIPTIONS = itertools.count()
_SUBSCRIBE = worker_pb2.DESCRIPTOR.services_by_name["Decode"].methods_by_name["Subscribe"]


def subscribe_raw(channel):
    """`Decode.Subscribe` whose replies are the `DeltaBatch`es' wire bytes, not parsed messages."""
    return channel.unary_stream(
        method_path(_SUBSCRIBE),
        request_serializer=worker_pb2.SubscribeRequest.SerializeToString,
        response_deserializer=None,
    )


def new_subscriber_id(worker_id: str) -> str:
    """Unique to this router and this subscription: a reopened subscription never inherits the
    requests (or the aborts) of the one before."""
    return f"{_ROUTER_ID}/{worker_id}/{next(_SUBSCRIPTIONS)}"


async def _status_error(call) -> grpc.aio.AioRpcError:
    """The error a finished call ended with, as the call's own read would have raised it."""
    code, details = await call.code(), await call.details()
    return grpc.aio.AioRpcError(code, await call.initial_metadata(), await call.trailing_metadata(), details)


class DeltaSubscription:
    def __init__(self, subscriber_id: str, worker_name: str, inboxes: dict[str, RequestInbox]):
        self.subscriber_id = subscriber_id
        self.worker_name = worker_name
        self._inboxes = inboxes
        """request id -> inbox, shared with the client (which registers and drops them)."""
        self.broken = False
        self._call = None
        self._reader: Optional[asyncio.Task] = None

    @classmethod
    async def open(
        cls, subscribe, subscriber_id: str, worker_name: str, inboxes: dict[str, RequestInbox], timeout: float
    ) -> Optional[DeltaSubscription]:
        """Subscribe (`subscribe`: `subscribe_raw`'s call, cluster token included) and wait until
        the worker has the subscription in place (its initial metadata). None when the worker has
        no `Subscribe` (an older one: read each request's own stream). Raises ServiceError when the
        worker cannot be reached in `timeout`."""
        try:
            call = subscribe(worker_pb2.SubscribeRequest(subscriber_id=subscriber_id))
        except CALL_ERRORS as e:  # the channel was closed: the worker left
            raise error_from_rpc(e, worker_name) from None
        try:
            await asyncio.wait_for(call.initial_metadata(), timeout)
            if call.done():  # refused before it began (or unreachable): the status says why
                raise await _status_error(call)
        except CALL_ERRORS as e:
            call.cancel()
            if isinstance(e, grpc.aio.AioRpcError) and e.code() == grpc.StatusCode.UNIMPLEMENTED:
                return None
            raise error_from_rpc(e, worker_name) from None
        except asyncio.TimeoutError:
            call.cancel()
            raise ServiceError(
                ErrorCode.UNAVAILABLE, f"{worker_name} did not answer a subscription in {timeout:g}s"
            ) from None
        except BaseException:
            call.cancel()
            raise
        sub = cls(subscriber_id, worker_name, inboxes)
        sub._call = call
        sub._reader = asyncio.ensure_future(sub._read())
        return sub

    def inbox(self) -> RequestInbox:
        return RequestInbox(self)

    async def _read(self) -> None:
        error = ServiceError(ErrorCode.UNAVAILABLE, f"{self.worker_name} ended its delta subscription")
        try:
            inboxes = self._inboxes
            async for batch in self._call:
                dispatch(batch, inboxes)
        except CALL_ERRORS as e:
            error = error_from_rpc(e, self.worker_name)
        except asyncio.CancelledError:
            error = ServiceError(ErrorCode.UNAVAILABLE, f"the router closed its connection to {self.worker_name}")
            raise
        finally:
            self._break(error)

    def _break(self, error: ServiceError) -> None:
        self.broken = True
        failed = [inbox for inbox in self._inboxes.values() if inbox.subscription is self]
        if failed:
            logger.warning("subscription to %s broke with %d request(s) open: %s", self.worker_name, len(failed), error)
        for inbox in failed:
            inbox.fail(error)

    async def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
