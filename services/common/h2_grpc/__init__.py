"""A gRPC server on an HTTP/2 of its own (asyncio; HPACK decoding by `hpack`), for a front door whose
streamed messages are many and small: `server.py` says why and what it serves."""

from services.common.h2_grpc.server import H2GrpcServer

__all__ = ["H2GrpcServer"]
