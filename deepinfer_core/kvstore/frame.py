"""The frame of one stored KV block: a fixed header in front of the block's bytes.

An entry is the same bytes in the host pool (one slot) and on disk (one file), so moving it is one
contiguous transfer each way. The header names what the bytes are and how to check them:

    magic "DIKVBLK1" | frame version | checksum algorithm | payload length | block key | namespace | checksum

A reader trusts nothing it has not checked: the length, the key it asked for, the namespace (model,
weights and KV layout) and the checksum of the payload must all match, else the entry is corrupt.
xxhash's XXH3-128 is the checksum where the package is installed (several GB/s), else blake2b-128
from the standard library; the algorithm is in the header, so engines with and without xxhash read
each other's entries.
"""

from __future__ import annotations

import hashlib
import struct

MAGIC = b"DIKVBLK1"
FRAME_VERSION = 1
HEADER_BYTES = 128
"""Header size; also the payload's alignment inside a slot (any KV dtype can view it)."""
_HEADER = struct.Struct("<8sHBxIQ16s16s16s")  # magic, version, algorithm, pad, reserved, length, key, ns, sum
_BLAKE2B, _XXH3 = 1, 2

try:  # optional: faster checksums
    import xxhash as _xxhash
except ImportError:  # blake2b is always there
    _xxhash = None


class CorruptEntry(ValueError):
    """An entry failed a check; the message says which."""


def default_algorithm() -> int:
    return _XXH3 if _xxhash is not None else _BLAKE2B


def checksum(payload: memoryview, algorithm: int) -> bytes:
    """16-byte checksum of the payload (hashlib and xxhash release the GIL on large buffers)."""
    if algorithm == _BLAKE2B:
        return hashlib.blake2b(payload, digest_size=16).digest()
    if algorithm == _XXH3 and _xxhash is not None:
        return _xxhash.xxh3_128_digest(payload)
    raise CorruptEntry(f"checksum algorithm {algorithm} is not available in this build")


def seal(slot: memoryview, key: bytes, namespace: bytes, algorithm: int | None = None) -> None:
    """Write the header of the payload already in `slot[HEADER_BYTES:]`."""
    algorithm = default_algorithm() if algorithm is None else algorithm
    payload = slot[HEADER_BYTES:]
    header = _HEADER.pack(
        MAGIC, FRAME_VERSION, algorithm, 0, len(payload), key, namespace, checksum(payload, algorithm)
    )
    slot[: len(header)] = header
    slot[len(header) : HEADER_BYTES] = bytes(HEADER_BYTES - len(header))


def verify(slot: memoryview, key: bytes, namespace: bytes) -> None:
    """Raise CorruptEntry unless `slot` holds a sound frame of block `key` in `namespace`."""
    magic, version, algorithm, reserved, length, got_key, got_ns, got_sum = _HEADER.unpack_from(slot)
    if magic != MAGIC:
        raise CorruptEntry("not a KV block frame (bad magic)")
    if version != FRAME_VERSION:
        raise CorruptEntry(f"frame version {version}; this build reads {FRAME_VERSION}")
    if reserved or any(slot[_HEADER.size : HEADER_BYTES]):
        raise CorruptEntry("damaged header (reserved bytes are not zero)")
    if length != len(slot) - HEADER_BYTES:
        raise CorruptEntry(f"payload of {length} bytes, expected {len(slot) - HEADER_BYTES}")
    if got_key != key:
        raise CorruptEntry("the entry holds another block's key")
    if got_ns != namespace:
        raise CorruptEntry("the entry belongs to another model or KV layout")
    if checksum(slot[HEADER_BYTES:], algorithm) != got_sum:
        raise CorruptEntry("checksum mismatch")


def problem(slot: memoryview, key: bytes, namespace: bytes) -> str | None:
    """What is wrong with the frame in `slot` for block `key` (None: it is sound)."""
    try:
        verify(slot, key, namespace)
    except CorruptEntry as e:
        return str(e)
    return None
