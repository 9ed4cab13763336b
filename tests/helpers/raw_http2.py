"""A raw HTTP/2 client for tests of the gRPC server's protocol handling: frames written by hand
(`services/common/h2_grpc/http2.py`), frames read back one by one, header blocks decoded by
`hpack.Decoder` as any client's would be."""

from __future__ import annotations

import socket
import time
from typing import NamedTuple

import hpack

from services.common.h2_grpc import http2


class Frame(NamedTuple):
    kind: int
    flags: int
    stream_id: int
    payload: bytes


def request_block(path: bytes, extra=()) -> bytes:
    """A gRPC request's header block for `path` (literals only)."""
    headers = [(b":method", b"POST"), (b":scheme", b"http"), (b":authority", b"t"), (b":path", path)]
    return http2.header_block([*headers, (b"content-type", b"application/grpc"), (b"te", b"trailers"), *extra])


def message(payload: bytes) -> bytes:
    return b"\x00" + len(payload).to_bytes(4, "big") + payload


class RawClient:
    def __init__(self, port: int, settings: dict | None = None, timeout_s: float = 10.0):
        """Connects, sends the preface and `settings` (SETTINGS frame); `timeout_s` bounds each wait."""
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
        self.timeout_s = timeout_s
        self.decoder = hpack.Decoder()
        self._buf = bytearray()
        self.send(http2.PREFACE + http2.settings_frame(settings or {}))

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def frame(self) -> Frame | None:
        """The next frame, or None when the server closed the connection."""
        while True:
            if len(self._buf) >= 9:
                length = int.from_bytes(self._buf[:3], "big")
                if len(self._buf) >= 9 + length:
                    head, payload = self._buf[:9], bytes(self._buf[9 : 9 + length])
                    del self._buf[: 9 + length]
                    return Frame(head[3], head[4], int.from_bytes(head[5:9], "big") & 0x7FFFFFFF, payload)
            chunk = self.sock.recv(65536)
            if not chunk:
                return None
            self._buf += chunk

    def until(self, wanted, what: str) -> Frame:
        """Frames are read (header blocks decoded in order) until `wanted(frame)`; that frame."""
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            f = self.frame()
            assert f is not None, f"the connection closed while waiting for {what}"
            if wanted(f):
                return f
        raise AssertionError(f"no {what} within {self.timeout_s} s")

    def headers(self, f: Frame) -> dict:
        return dict(self.decoder.decode(f.payload, raw=True))

    def close(self) -> None:
        self.sock.close()
