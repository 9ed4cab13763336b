"""The listening sockets of the public ports (HTTP and the gateway's own gRPC server)."""

from __future__ import annotations

import socket


def listen_socket(host: str, port: int, reuse_port: bool) -> socket.socket:
    """A socket bound to `host:port` (0: any free port), not yet listening; `reuse_port`:
    SO_REUSEPORT, so several API processes share the port. Raises OSError when it cannot bind."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock
