"""A head served as in the cluster, for the fast lane's tests: a real worker server (gRPC on
127.0.0.1, its engine a token source or the embedded model) read through the router's delta
subscription, the router and the gateway in one process, the HTTP front door on uvicorn (httptools).
The servers run on an event loop of their own thread; the tests speak raw HTTP/1.1 over sockets,
so they see the chunked framing byte for byte.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time

import pytest

from deepinfer_core.builtin import TINY_MODEL_DIR
from deepinfer_core.tokenizer import load_tokenizer
from deepinfer_proto import gateway_pb2_grpc
from services.common.workers import POOL_COLOCATED
from services.gateway.core import GatewayConfig, GatewayCore
from services.gateway.front import GatewayFront
from services.gateway.router_client import LocalRouterClient
from services.router.clients import GrpcWorkerClient
from services.router.config import RouterConfig
from services.router.core import RouterCore
from services.router.registry import PoolRegistry
from services.workers.spec import WorkerSpec
from services.workers.worker_server import WorkerServer

WAIT_S = 60.0
"""The bound on every wait of these tests."""


@contextlib.contextmanager
def token_source_head(kind: str, step_s: float, grpc_server: str = "h2"):
    """A `LaneHead` over a token source of one token every `step_s`. `kind` "native": the lanes'
    compiled half takes what it can; "python": as where it is not built (the Python dispatch of the
    subscription's bytes, no native lanes). `grpc_server`: the gateway's ("h2" or "grpcio").
    `.engine` is the source, `.native` says which kind."""
    from benchmarks.token_source import TokenSourceEngine, token_source_config
    from services import native
    from services.gateway import grpc_lane, sse_lane
    from services.router import subscription

    if kind == "native" and native.NativeLane is None:
        pytest.skip("services.native was not built (no C compiler at install)")
    with pytest.MonkeyPatch.context() as patch:
        if kind == "python":
            patch.setattr(sse_lane, "NativeLane", None)
            patch.setattr(grpc_lane, "NativeLane", None)
            patch.setattr(subscription, "dispatch", native._dispatch_python)
        engine = TokenSourceEngine(token_source_config(), step_period_s=step_s, tokens_per_step=1)
        served = LaneHead(engine=engine, grpc_server=grpc_server)
        served.engine, served.native = engine, kind == "native"
        try:
            yield served
        finally:
            served.stop()


def concurrently(run, cases: list) -> list:
    """`run(case)` for every case at once, each on a thread of its own: the results, in order."""
    out: list = [None] * len(cases)

    def one(i: int) -> None:
        out[i] = run(cases[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert all(o is not None for o in out), "a stream did not end"
    return out


def taken_by(head) -> int:
    """Deltas taken by the kind of lane `head` runs."""
    from services import native
    from services.common.fast_lane import COUNTS

    return native.lanes_taken() if head.native else COUNTS.python_taken


class LaneHead:
    def __init__(self, engine=None, engine_args=None, model_len: int = 8192, grpc_server: str = "h2"):
        """`engine`: a stand-in engine for the worker (None: the embedded model with `engine_args`);
        `grpc_server`: the gateway's gRPC server ("h2" or "grpcio")."""
        self.grpc_server = grpc_server
        kw = {"engine_args": engine_args} if engine_args is not None else {}
        self.worker = WorkerServer(WorkerSpec("lane-w0", POOL_COLOCATED, metrics=False, **kw), engine=engine)
        self.worker.start(timeout_s=WAIT_S)
        self.model_len = model_len
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.call(self._start())
        self.port = self.front.http_port

    def call(self, coro, timeout_s: float = WAIT_S):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    async def _start(self) -> None:
        registry = PoolRegistry(lambda info: GrpcWorkerClient(info))
        await registry.add(self.worker.info)
        self.router = RouterCore(registry, RouterConfig(pools=(POOL_COLOCATED,)), "m")
        config = GatewayConfig("m", self.model_len, grpc_server=self.grpc_server)
        self.core = GatewayCore(config, load_tokenizer(TINY_MODEL_DIR), LocalRouterClient(self.router))
        self.front = GatewayFront(self.core, gateway_pb2_grpc.ClusterServicer())
        self.front.bind("127.0.0.1", 0, 0)
        await self.front.start()

    def idle(self) -> dict:
        """What is still held for requests: on the worker, in the router, in admission."""

        async def read():
            worker = next(iter(self.router.registry.workers.values()))
            return {
                "router_inflight": worker.inflight,
                "router_tokens": worker.inflight_tokens,
                "inboxes": len(worker.client._inboxes),
                "admitted": self.core.active,
            }

        return self.call(read())

    def squeeze_connection(self, client: socket.socket) -> bool:
        """Give the server's end of `client`'s connection a small send buffer and write-buffer limit,
        so that a client that does not read makes the server pause its writes after a few KB;
        whether that connection was there yet. Matched by address: a connection left open by an
        earlier test must not be the one squeezed."""
        client_address = client.getsockname()

        async def squeeze() -> bool:
            for protocol in self.front.http_server.server_state.connections:
                if protocol.transport.get_extra_info("peername")[:2] == client_address[:2]:
                    protocol.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
                    protocol.transport.set_write_buffer_limits(high=2048)
                    return True
            return False

        return self.call(squeeze())

    def stop(self) -> None:
        self.call(self.front.stop())
        self.call(self.router.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.worker.stop()


def post(port: int, path: str, body: dict, rcvbuf: int = 0) -> socket.socket:
    """A connection with `body` POSTed; `rcvbuf`: the socket's receive buffer (0: the default)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(WAIT_S)
    sock.connect(("127.0.0.1", port))
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    sock.sendall(head.encode() + data)
    return sock


def read_response(sock: socket.socket) -> tuple[bytes, list[bytes]]:
    """(the response head, each chunk of its chunked body in order), reading to the last chunk."""
    buf = bytearray()
    deadline = time.monotonic() + WAIT_S

    def more() -> None:
        assert time.monotonic() < deadline, "the response did not end in time"
        data = sock.recv(1 << 16)
        assert data, "the connection closed before the response ended"
        buf.extend(data)

    while b"\r\n\r\n" not in buf:
        more()
    end = buf.index(b"\r\n\r\n") + 4
    head, pos, chunks = bytes(buf[:end]), end, []
    assert b"transfer-encoding: chunked" in head.lower(), head
    while True:
        while b"\r\n" not in buf[pos:]:
            more()
        line_end = buf.index(b"\r\n", pos)
        size = int(buf[pos:line_end], 16)
        while len(buf) < line_end + 2 + size + 2:
            more()
        chunk = bytes(buf[line_end + 2 : line_end + 2 + size])
        assert buf[line_end + 2 + size : line_end + 4 + size] == b"\r\n", "a chunk not framed as uvicorn frames it"
        pos = line_end + 4 + size
        if size == 0:
            return head, chunks
        chunks.append(chunk)


def sse_events(chunks: list[bytes]) -> list[bytes]:
    """The SSE events of a body's chunks (`read_response`), each `data: ...\\n\\n`. Every chunk is
    whole events: one, as uvicorn's `send` writes them, but the last, which ends with `[DONE]` and
    may carry the events before it (a stream's end leaves in one write)."""
    for c in chunks:
        assert c.startswith(b"data: ") and c.endswith(b"\n\n") and (c.count(b"\n\n") == 1 or c is chunks[-1]), c
    assert chunks[-1].endswith(b"data: [DONE]\n\n"), chunks[-1]
    return [e + b"\n\n" for c in chunks for e in c.split(b"\n\n")[:-1]]
