"""gRPC over HTTP/2 on the wire: the length-prefixed message, metadata as headers, the `grpc-timeout`
header, and the percent-encoded `grpc-message`."""

from __future__ import annotations

import base64
import re
import zlib
from typing import Optional

MESSAGE_PREFIX = 5
"""A message's prefix: a compressed flag (1 byte) and its length (4 bytes, big-endian)."""
_NOT_METADATA = frozenset(
    {"content-type", "te", "grpc-timeout", "grpc-encoding", "grpc-accept-encoding", "content-length"}
    | {"grpc-status", "grpc-message"}
)


def message(payload: bytes) -> bytes:
    """A serialized message as gRPC frames it (uncompressed)."""
    return b"\x00" + len(payload).to_bytes(4, "big") + payload


_TIMEOUT = re.compile(r"^(\d{1,8})([HMSmun])$")
_UNIT_S = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}


def timeout_s(value: str) -> Optional[float]:
    """`grpc-timeout` (e.g. "250m") in seconds; None when it is not one."""
    m = _TIMEOUT.match(value)
    return int(m.group(1)) * _UNIT_S[m.group(2)] if m else None


def encode_details(details: str) -> str:
    """`grpc-message`: UTF-8, with '%' and bytes outside printable ASCII percent-encoded."""
    out = []
    for b in details.encode("utf-8"):
        out.append(chr(b) if 0x20 <= b <= 0x7E and b != 0x25 else f"%{b:02X}")
    return "".join(out)


def decompress(encoding: str, data: bytes) -> bytes:
    """A compressed message's bytes (`grpc-encoding` gzip or deflate); ValueError otherwise, or when
    they do not inflate."""
    if encoding not in ("gzip", "deflate"):
        raise ValueError(f"messages compressed with {encoding!r} are not accepted")
    try:
        return zlib.decompress(data, 16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS)
    except zlib.error as e:
        raise ValueError(f"{encoding} data that does not inflate: {e}") from None


class MessageTooLarge(Exception):
    def __init__(self, size: int, limit: int):
        super().__init__(f"Received message larger than max ({size} vs. {limit})")


def take_messages(buf: bytearray, encoding: str, limit: int) -> list[bytes]:
    """The whole messages at the head of `buf`, taken from it and decompressed. Raises
    `MessageTooLarge` for one over `limit` bytes (before it is read, or once inflated), ValueError
    for a compressed one that cannot be read."""
    out = []
    while len(buf) >= MESSAGE_PREFIX:
        length = int.from_bytes(buf[1:5], "big")
        if length > limit:
            raise MessageTooLarge(length, limit)
        end = MESSAGE_PREFIX + length
        if len(buf) < end:
            break
        payload = bytes(buf[MESSAGE_PREFIX:end])
        if buf[0]:
            payload = decompress(encoding, payload)
            if len(payload) > limit:
                raise MessageTooLarge(len(payload), limit)
        del buf[:end]
        out.append(payload)
    return out


ACCEPT_ENCODING = "identity,deflate,gzip"


def metadata_of(headers) -> tuple:
    """Metadata as `invocation_metadata()` (a request's) or `trailing_metadata()` (a response's) gives
    it: the headers less the pseudo-headers and gRPC's own, `-bin` values base64-decoded."""
    out = []
    for key, value in headers:
        key = key.decode("ascii")
        if key[0] == ":" or key in _NOT_METADATA:
            continue
        if key.endswith("-bin"):
            out.append((key, base64.b64decode(value + b"=" * (-len(value) % 4))))
        else:
            out.append((key, value.decode("utf-8", "replace")))
    return tuple(out)


def header_pairs(metadata) -> list:
    """Metadata as header pairs: keys lowercased, `-bin` values base64-encoded (unpadded)."""
    out = []
    for key, value in metadata or ():
        key = key.lower()
        if key.endswith("-bin"):
            value = base64.b64encode(value if isinstance(value, bytes) else value.encode()).rstrip(b"=")
        out.append((key.encode("ascii"), value if isinstance(value, bytes) else value.encode("utf-8")))
    return out
