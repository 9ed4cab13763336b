"""HTTP/2 on the wire (RFC 9113) as the gRPC server speaks it: frame types, flags, error codes and
settings, the frames it writes, and its header blocks.

Header blocks are HPACK (RFC 7541) literals that are never indexed: a response's HEADERS frame
then depends on nothing the connection remembers, so its constant part is made once and reused,
and no encoder state is kept at all. Each one costs the peer a few bytes more than an indexed
field would, once a call. What clients send is decoded by `hpack.Decoder`, which keeps the
dynamic table their encoders index into.
"""

from __future__ import annotations

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
"""What a client sends first."""

# frame types
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)

# flags
END_STREAM = 0x1
ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20

# error codes
NO_ERROR = 0x0
PROTOCOL_ERROR = 0x1
INTERNAL_ERROR = 0x2
FLOW_CONTROL_ERROR = 0x3
STREAM_CLOSED = 0x5
FRAME_SIZE_ERROR = 0x6
REFUSED_STREAM = 0x7
CANCEL = 0x8
COMPRESSION_ERROR = 0x9
ENHANCE_YOUR_CALM = 0xB

# settings
HEADER_TABLE_SIZE = 0x1
ENABLE_PUSH = 0x2
MAX_CONCURRENT_STREAMS = 0x3
INITIAL_WINDOW_SIZE = 0x4
MAX_FRAME_SIZE = 0x5
MAX_HEADER_LIST_SIZE = 0x6

DEFAULT_WINDOW = 65535
"""Every flow-control window's size before SETTINGS or WINDOW_UPDATE change it."""
DEFAULT_MAX_FRAME = 16384
"""The largest frame payload a peer takes before its SETTINGS say otherwise (and the largest this
server takes: it does not raise its own)."""
MAX_WINDOW = 2**31 - 1
RECEIVE_WINDOW = 1 << 24
"""The connection's and each stream's receive window, as this package's ends advertise them."""
DEFAULT_TABLE_SIZE = 4096


def frame(kind: int, flags: int, stream_id: int, payload=b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream_id.to_bytes(4, "big") + payload


def data_frame(stream_id: int, payload) -> bytes:
    """One DATA frame of `payload` (no flags): the caller has checked the flow-control windows and the
    peer's maximum frame size."""
    return len(payload).to_bytes(3, "big") + b"\x00\x00" + stream_id.to_bytes(4, "big") + payload


def settings_frame(settings: dict[int, int]) -> bytes:
    payload = b"".join(k.to_bytes(2, "big") + v.to_bytes(4, "big") for k, v in settings.items())
    return frame(SETTINGS, 0, 0, payload)


SETTINGS_ACK = frame(SETTINGS, ACK, 0)


def window_update(stream_id: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, stream_id, increment.to_bytes(4, "big"))


def rst_stream(stream_id: int, error_code: int) -> bytes:
    return frame(RST_STREAM, 0, stream_id, error_code.to_bytes(4, "big"))


def ping(opaque: bytes, ack: bool = False) -> bytes:
    return frame(PING, ACK if ack else 0, 0, opaque)


def goaway(last_stream_id: int, error_code: int = NO_ERROR) -> bytes:
    """GOAWAY: the peer opens no new streams; those up to `last_stream_id` finish (NO_ERROR), or the
    connection ends on an error."""
    return frame(GOAWAY, 0, 0, last_stream_id.to_bytes(4, "big") + error_code.to_bytes(4, "big"))


def headers_frames(stream_id: int, block: bytes, end_stream: bool, max_frame: int) -> bytes:
    """A header block as one HEADERS frame, or HEADERS then CONTINUATIONs where it exceeds `max_frame`."""
    flags = END_STREAM if end_stream else 0
    if len(block) <= max_frame:
        return frame(HEADERS, flags | END_HEADERS, stream_id, block)
    pieces = [block[i : i + max_frame] for i in range(0, len(block), max_frame)]
    out = [frame(HEADERS, flags, stream_id, pieces[0])]
    for i, piece in enumerate(pieces[1:], 2):
        out.append(frame(CONTINUATION, END_HEADERS if i == len(pieces) else 0, stream_id, piece))
    return b"".join(out)


# ---- HPACK literals ------------------------------------------------------------------------------
def hpack_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    """An HPACK integer with a `prefix_bits`-bit prefix; `first`: the bits above the prefix."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def literal(name: bytes, value: bytes) -> bytes:
    """One header field as a literal never added to the dynamic table (RFC 7541 6.2.2), name and
    value as plain octets."""
    return b"\x00" + hpack_int(len(name), 7) + name + hpack_int(len(value), 7) + value


STATUS_200 = b"\x88"
"""`:status: 200`, entry 8 of HPACK's static table (which no peer can change)."""


def header_block(headers) -> bytes:
    """(name, value) byte pairs as a header block of literals."""
    return b"".join([literal(name, value) for name, value in headers])


def table_size_update(size: int) -> bytes:
    """The dynamic table size update that acknowledges a peer's smaller HEADER_TABLE_SIZE."""
    return hpack_int(size, 5, 0x20)
