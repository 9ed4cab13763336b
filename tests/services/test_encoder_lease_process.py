"""A vision encoder's leases against real processes: an encoder worker process parks embeddings for a
consumer process that is SIGKILLed before it reads them (a PE, or the router that would release them,
dying): the encoder lets the slots go when the leases end, by itself, and serves on."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import grpc
import pytest

pytest.importorskip("nixl")

from proto import common_pb2, worker_pb2, worker_pb2_grpc  # noqa: E402
from tests.helpers.images import make_png  # noqa: E402

LEASE_S = 1.0
_CONTEXT = multiprocessing.get_context("spawn")


def _encoder(addresses) -> None:
    from deepinfer_core.multimodal.encoder_config import EncoderConfig
    from services.common.workers import POOL_ENCODER
    from services.workers.spec import WorkerSpec
    from services.workers.worker_server import WorkerServer

    config = EncoderConfig(lease_s=LEASE_S, max_wait_s=0.01)
    server = WorkerServer(WorkerSpec("ve-proc", POOL_ENCODER, encoder=config, metrics=False))
    addresses.put(server.start().address)
    while True:
        time.sleep(60)


def _consumer(address: str, parked) -> None:
    """Asks for two images' embeddings, says so, and never reads nor releases them."""
    with grpc.insecure_channel(address) as ch:
        pngs = [make_png(40, 36, seed=s) for s in (7, 8)]
        reply = worker_pb2_grpc.EncoderStub(ch).Encode(
            worker_pb2.EncodeRequest(request_id="doomed", images=pngs), timeout=60
        )
        parked.put([h.lease_id for h in reply.handles])
        time.sleep(600)


def _leases(stub) -> int:
    return stub.Stats(common_pb2.StatusRequest(), timeout=10).embedding_leases


@pytest.fixture(scope="module")
def encoder():
    addresses = _CONTEXT.Queue()
    proc = _CONTEXT.Process(target=_encoder, args=(addresses,), daemon=True)
    proc.start()
    try:
        yield addresses.get(timeout=120)
    finally:
        proc.kill()
        proc.join(10)


def test_embeddings_parked_for_a_consumer_that_dies_unread_are_freed_when_their_leases_end(encoder):
    parked = _CONTEXT.Queue()
    consumer = _CONTEXT.Process(target=_consumer, args=(encoder, parked), daemon=True)
    consumer.start()
    lease_ids = parked.get(timeout=120)
    os.kill(consumer.pid, signal.SIGKILL)  # dies holding two leases it never read
    consumer.join(10)
    with grpc.insecure_channel(encoder) as ch:
        worker, encoder_stub = worker_pb2_grpc.WorkerStub(ch), worker_pb2_grpc.EncoderStub(ch)
        assert len(lease_ids) == 2 and _leases(worker) == 2
        killed = time.monotonic()
        while _leases(worker) and time.monotonic() - killed < 10:
            time.sleep(0.1)
        freed_after = time.monotonic() - killed
        assert _leases(worker) == 0, "the dead consumer's leases were never freed"
        assert freed_after < LEASE_S + 2.0 + 2.0  # the lease, its reuse grace, polling slack
        # the encoder serves on; a consumer that gives its lease back frees it at once
        reply = encoder_stub.Encode(
            worker_pb2.EncodeRequest(request_id="next", images=[make_png(30, 30, seed=9)]), timeout=60
        )
        assert _leases(worker) == 1
        release = worker_pb2.ReleaseRequest(lease_ids=[h.lease_id for h in reply.handles])
        assert encoder_stub.Release(release, timeout=10).released == 1 and _leases(worker) == 0
