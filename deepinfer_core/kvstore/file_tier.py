"""L3: framed entries in files under a directory, one file per block, named by its key.

    <directory>/<first key byte, hex>/<key, hex>.kvblock      (+ ".tmp" while it is being written)
    <directory>/index.sqlite3                                 (`index.StoreIndex`)

Runs on the store's I/O thread only. A save seals each staged slot (header + checksum), reserves
room in the index, writes the frames to temporary files through the file mover and publishes them
(rename + ready). A load opens the files of a prefix, checks each one's size, reads them into
staged slots and verifies every frame; the first file that is missing, short, unreadable or
corrupt ends the prefix there. A corrupt entry is removed from the store so that nobody reads it
again; the caller recomputes what was not loaded.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional

from deepinfer_core.kvstore import frame
from deepinfer_core.kvstore.host_pool import HostPool
from deepinfer_core.kvstore.index import StoreIndex
from deepinfer_core.transfer.storage_io import StorageError

logger = logging.getLogger(__name__)

HASH_THREADS = min(4, os.cpu_count() or 1)
"""Threads that seal and verify frames side by side (checksums release the GIL): one thread's
checksum is slower than a file read from the page cache."""
IO_TIMEOUT_S = 60.0
"""Longest one batch of file I/O may take before it fails (a load's own deadline is shorter and
is kept by the loader: a late load is dropped while its I/O finishes here)."""


@dataclass
class SaveJob:
    keys: list[bytes]
    slots: list[int]
    ready: Optional[object] = None
    """Event of the device-to-host copy into the slots (None: the bytes are there)."""


@dataclass
class LoadJob:
    keys: list[bytes]
    slots: list[int]
    started: float = field(default_factory=time.monotonic)


@dataclass
class IOResult:
    job: SaveJob | LoadJob
    ok: int = 0
    """Save: blocks written. Load: blocks read and verified, from the first."""
    skipped: int = 0
    """Save: already stored. Load: unused."""
    dropped: int = 0
    """Save: not written (no room, write failed)."""
    corrupt: int = 0
    failed: bool = False
    """An I/O error or a missing entry cut the job short."""
    evicted: int = 0
    total_bytes: int = -1
    """The directory's entry bytes after this job (-1: not read)."""
    finished: float = 0.0


class FileTier:
    def __init__(self, directory: str, capacity_bytes: int, pool: HostPool, namespace: bytes, file_io):
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self.pool = pool
        self.namespace = namespace
        self.io = file_io
        self.index = StoreIndex(directory, capacity_bytes, self.path_of)
        self._hashers = ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="kv-store-hash")

    @property
    def location(self) -> str:
        return self.directory

    def ready_keys(self, keys: list[bytes]) -> set[bytes]:
        """Which of `keys` have a published entry (one index query)."""
        return self.index.ready_keys(keys)

    known_keys = ready_keys
    """What a save skips: the index is exact and local, so the same query."""

    def total_bytes(self) -> int:
        return self.index.total_bytes()

    def path_of(self, key: bytes) -> str:
        name = key.hex()
        return os.path.join(self.directory, name[:2], name + ".kvblock")

    @staticmethod
    def _tmp_of(path: str) -> str:
        return path + ".tmp"

    def transfer_item(self, slot: int, fd: int) -> tuple[int, int, int]:
        """What the file mover takes for one entry: (slot address, frame bytes, file descriptor)."""
        return (self.pool.buffer[slot].data_ptr(), self.pool.frame_bytes, fd)

    # ---- save ---------------------------------------------------------------------------
    def save(self, job: SaveJob) -> IOResult:
        if job.ready is not None:
            job.ready.synchronize()
        out = IOResult(job)
        slot_of = dict(zip(job.keys, job.slots))
        reservation = self.index.reserve(job.keys, self.pool.frame_bytes)
        out.skipped, out.evicted, out.total_bytes = reservation.stored, reservation.evicted, reservation.total_bytes
        out.dropped = len(job.keys) - reservation.stored - len(reservation.keys)
        keys, fds = reservation.keys, []
        try:
            list(self._hashers.map(lambda k: frame.seal(self.pool.frame(slot_of[k]), k, self.namespace), keys))
            for key in keys:
                path = self.path_of(key)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                fds.append(os.open(self._tmp_of(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))
            self.io.write([self.transfer_item(slot_of[k], fd) for k, fd in zip(keys, fds)], IO_TIMEOUT_S)
        except (OSError, StorageError) as e:
            logger.warning("saving %d KV blocks failed: %s", len(keys), e)
            _close(fds)
            self.index.remove(keys, [self._tmp_of(self.path_of(k)) for k in keys])
            out.dropped += len(keys)
            out.failed = True
            return out
        _close(fds)
        published = self.index.publish(keys, lambda k: self._tmp_of(self.path_of(k)))
        out.ok = len(published)
        out.dropped += len(keys) - len(published)
        out.finished = time.monotonic()
        return out

    # ---- load ---------------------------------------------------------------------------
    def load(self, job: LoadJob) -> IOResult:
        out = IOResult(job)
        fds: list[int] = []
        try:
            self._open_prefix(job.keys, fds, out)
            if fds:
                self.io.read([self.transfer_item(s, fd) for s, fd in zip(job.slots, fds)], IO_TIMEOUT_S)
        except StorageError as e:
            logger.warning("reading %d KV store entries failed: %s", len(fds), e)
            out.failed, fds_read = True, 0
        else:
            fds_read = len(fds)
        finally:
            _close(fds)
        checks = self._hashers.map(self._check, job.keys[:fds_read], job.slots)
        for key, problem in zip(job.keys, list(checks)):
            if problem is not None:
                self._drop_corrupt(key, problem, out)
                break
            out.ok += 1
        if out.ok:
            self.index.touch(job.keys[: out.ok])
        out.finished = time.monotonic()
        out.total_bytes = self.index.total_bytes()
        return out

    def _check(self, key: bytes, slot: int) -> str | None:
        return frame.problem(self.pool.frame(slot), key, self.namespace)

    def _open_prefix(self, keys: list[bytes], fds: list[int], out: IOResult) -> None:
        """Open the files of `keys` from the first, up to the first one missing or of the wrong size."""
        for key in keys:
            path = self.path_of(key)
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:  # evicted since the lookup (or never written): the index forgets it
                self.index.remove([key])
                out.failed = True
                return
            size = os.fstat(fd).st_size
            if size != self.pool.frame_bytes:
                os.close(fd)
                self._drop_corrupt(key, f"file of {size} bytes, expected {self.pool.frame_bytes}", out)
                return
            fds.append(fd)

    def _drop_corrupt(self, key: bytes, why: str, out: IOResult) -> None:
        logger.warning("KV store entry %s is corrupt (%s): removed, its blocks are recomputed", key.hex(), why)
        self.index.remove([key], [self.path_of(key)])
        out.corrupt += 1

    def close(self) -> None:
        self._hashers.shutdown()
        self.index.close()
        self.io.close()


def _close(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()
