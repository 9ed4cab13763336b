"""L3 in an S3-compatible bucket: framed entries as objects, one per block, named by its key.

    s3://<bucket>/<prefix><key, hex>.kvblock

The same frames as the file tier (`frame.py`: version, key, namespace, checksum), moved between
the host pool and the bucket by NIXL's OBJ backend (`transfer/object_io.py`); `FileTier`'s jobs
and results, on the store's I/O thread.

The index is the bucket itself, plus a ledger in each store:

- Which blocks are stored is asked of the bucket: `ready_keys` sends HEADs for a prompt's blocks,
  side by side in one NIXL call per run of keys, so an entry that any engine on any host has
  written is a hit at once, and one evicted by any of them is a miss. S3 makes a PUT visible whole or not at all, so
  a reader never sees half an entry and no reservation or rename is needed.
- The byte limit and LRU order are kept in a ledger in this store's memory: the bucket's listing
  (sizes, write times) read at start and again by a save once the last one is `RELIST_S` old;
  then this store's own writes and hits. A save that would pass the limit first deletes the least
  recently used entries (by the ledger) from the bucket. The ledger also spares a decode step the
  copy of blocks it knows are stored; an entry another engine evicted is saved again once a
  listing has shown it gone.

Limits of that choice, for a bucket shared by several engines: recency is what this engine has
seen — an entry that only other engines read counts as old as its write here; engines writing at
once each see the others' writes only at their next listing, so together they can pass the limit
by what they write between listings (each keeps to it alone; a bucket lifecycle rule is a backstop);
an entry deleted by one engine while another reads it is a failed load there (recomputed). S3 has no
transactions to do better without a service beside it.

A load zeroes its slots, GETs the prefix's objects and checks every frame; the first object that
is missing, short (the zeroed tail fails the checksum), or corrupt ends the prefix there, and a
corrupt one is deleted so that nobody reads it again.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

from deepinfer_core.config import KVStoreConfig, bucket_of
from deepinfer_core.kvstore import frame
from deepinfer_core.kvstore.bucket import Bucket, StoreUnreachable
from deepinfer_core.kvstore.file_tier import HASH_THREADS, IO_TIMEOUT_S, IOResult, LoadJob, SaveJob
from deepinfer_core.kvstore.host_pool import HostPool
from deepinfer_core.transfer.object_io import NixlObjectIO, obj_params
from deepinfer_core.transfer.storage_io import StorageError

logger = logging.getLogger(__name__)

RELIST_S = 30.0
"""Least time between two listings of the bucket by one store (a listing is one request per 1000
entries: give each cluster its own prefix rather than one huge one)."""


LOOKUP_TIMEOUT_S = 2.0
"""Longest a PE's step waits for a lookup's HEADs (S3 answers one in tens of milliseconds, and
`object_io.REQUEST_THREADS` run side by side)."""
FIRST_RUN = 32
"""Keys in a lookup's first HEAD round."""
LOOKUP_PAUSE_S = 5.0
"""How long lookups are skipped (misses) after one failed."""


class Ledger:
    """Entries of the bucket as this store knows them: key -> bytes, least recently used first."""

    def __init__(self):
        self._entries: OrderedDict[bytes, int] = OrderedDict()
        self.total = 0
        self._lock = threading.Lock()  # the engine thread reads it (saves), the I/O thread writes it

    def known(self, keys: list[bytes]) -> set[bytes]:
        with self._lock:
            return {k for k in keys if k in self._entries}

    def add(self, keys: list[bytes], size: int) -> None:
        """Entries written or seen now: the most recently used."""
        with self._lock:
            for key in keys:
                self.total += size - self._entries.pop(key, 0)
                self._entries[key] = size

    def remove(self, keys: list[bytes]) -> None:
        with self._lock:
            for key in keys:
                self.total -= self._entries.pop(key, 0)

    def replace(self, listed, recent: set[bytes]) -> None:
        """The bucket's listing, oldest write first; `recent` (this store's hits since the last
        listing) stay the most recently used."""
        entries = OrderedDict((e.key, e.size) for e in sorted(listed, key=lambda e: e.modified))
        with self._lock:
            for key in [k for k in self._entries if k in recent and k in entries]:
                entries.move_to_end(key)
            self._entries = entries
            self.total = sum(entries.values())

    def oldest(self, need: int, exclude: set[bytes]) -> list[bytes]:
        """Least recently used keys (not in `exclude`) whose bytes add up to at least `need`."""
        out, freed = [], 0
        with self._lock:
            for key, size in self._entries.items():
                if freed >= need:
                    break
                if key not in exclude:
                    out.append(key)
                    freed += size
        return out


class ObjectTier:
    def __init__(self, config: KVStoreConfig, pool: HostPool, namespace: bytes, name: str):
        bucket, prefix = bucket_of(config.url)
        self.bucket = Bucket(bucket, prefix, config.endpoint, config.region)
        self.bucket.check()
        self.pool = pool
        self.namespace = namespace
        self.capacity_bytes = config.l3_bytes
        params = obj_params(bucket, config.endpoint, config.region, dict(os.environ))
        try:
            self.io = NixlObjectIO(name, params, pool.buffer)
            self._heads = NixlObjectIO(name, params)  # the engine thread's lookups: an agent of their own
        except StorageError as e:
            raise StoreUnreachable(f"KV store {config.url}: {e}") from e
        except ImportError as e:
            raise StoreUnreachable(f"KV store {config.url} needs the nixl package: {e}") from e
        self.ledger = Ledger()
        self._recent: set[bytes] = set()
        self._listed_at = 0.0
        self._lookups_paused_until = 0.0
        self._lookup_done = threading.Event()  # set: no lookup running
        self._lookup_done.set()
        self._relist()
        self._hashers = ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="kv-store-hash")

    @property
    def location(self) -> str:
        return self.bucket.url

    def _item(self, slot: int, key: bytes) -> tuple[int, int, str]:
        return (self.pool.buffer[slot].data_ptr(), self.pool.frame_bytes, self.bucket.object_key(key))

    def _relist(self) -> None:
        self.ledger.replace(list(self.bucket.list()), self._recent)
        self._recent.clear()
        self._listed_at = time.monotonic()

    # ---- what is stored -----------------------------------------------------------------
    def ready_keys(self, keys: list[bytes]) -> set[bytes]:
        """Which of `keys` the bucket holds, asked of it: HEADs side by side in one NIXL call per
        run of keys (32, then twice as many each time, up to the first run with a miss: a prompt
        stored only in part costs few requests), on a thread of its own so that the PE's step waits
        at most `LOOKUP_TIMEOUT_S` (then: what was found so far). While a late lookup still runs,
        and for `LOOKUP_PAUSE_S` after one failed, none is asked: a bucket that does not answer
        costs misses, not waits."""
        if not keys or time.monotonic() < self._lookups_paused_until or not self._lookup_done.is_set():
            return set()
        self._lookup_done.clear()
        found: list[set[bytes]] = [set()]
        # a daemon thread: one stuck in the SDK's retries must not hold the process at exit
        thread = threading.Thread(target=self._lookup, args=(keys, found), name="kv-store-lookup", daemon=True)
        thread.start()
        thread.join(LOOKUP_TIMEOUT_S)
        if thread.is_alive():
            logger.warning("KV store lookup in %s took over %.1f s: cut there", self.location, LOOKUP_TIMEOUT_S)
        return found[0]

    def _lookup(self, keys: list[bytes], found: list[set[bytes]]) -> None:
        """Fill `found[0]` run by run (a new set each time: the caller may take it at any point)."""
        try:
            start, size = 0, FIRST_RUN
            while start < len(keys):
                run = keys[start : start + size]
                present = self._present(self._heads, run)
                found[0] = found[0] | present
                if len(present) < len(run):
                    return
                start, size = start + size, size * 2
        except StorageError as e:
            logger.warning("KV store lookup in %s failed (%s): no lookups for %.0f s", self.location, e, LOOKUP_PAUSE_S)
            self._lookups_paused_until = time.monotonic() + LOOKUP_PAUSE_S
        finally:
            self._lookup_done.set()

    def _present(self, agent: NixlObjectIO, keys: list[bytes]) -> set[bytes]:
        there = agent.exists([self.bucket.object_key(k) for k in keys], self.pool.frame_bytes)
        return {k for k, present in zip(keys, there) if present}

    def known_keys(self, keys: list[bytes]) -> set[bytes]:
        """Which of `keys` this store knows to be stored (no request: a save's first filter)."""
        return self.ledger.known(keys)

    def total_bytes(self) -> int:
        return self.ledger.total

    # ---- save ---------------------------------------------------------------------------
    def save(self, job: SaveJob) -> IOResult:
        if job.ready is not None:
            job.ready.synchronize()
        out = IOResult(job)
        if time.monotonic() - self._listed_at > RELIST_S:
            self._relist()  # what others wrote and evicted since: the ledger this save is filtered and fitted by
        slot_of = dict(zip(job.keys, job.slots))
        size = self.pool.frame_bytes
        stored = self._stored(list(slot_of))
        self.ledger.add(sorted(stored), size)
        new = [k for k in slot_of if k not in stored]
        out.skipped = len(job.keys) - len(new)
        out.evicted = self._make_room(len(new) * size, exclude=set(job.keys))
        fit = max(0, min(len(new), (self.capacity_bytes - self.ledger.total) // size))
        keys = new[:fit]
        out.dropped = len(new) - fit
        try:
            list(self._hashers.map(lambda k: frame.seal(self.pool.frame(slot_of[k]), k, self.namespace), keys))
            self.io.write([self._item(slot_of[k], k) for k in keys], IO_TIMEOUT_S)
        except StorageError as e:
            logger.warning("saving %d KV blocks to %s failed: %s", len(keys), self.location, e)
            out.dropped += len(keys)
            out.failed = True
            out.total_bytes = self.ledger.total
            return out
        self.ledger.add(keys, size)
        out.ok = len(keys)
        out.total_bytes = self.ledger.total
        out.finished = time.monotonic()
        return out

    def _stored(self, keys: list[bytes]) -> set[bytes]:
        """Which of `keys` are in the bucket already (written by another engine, say)."""
        try:
            return self._present(self.io, keys)
        except StorageError:
            return set()

    def _make_room(self, need: int, exclude: set[bytes]) -> int:
        """Delete least recently used entries until `need` more bytes fit; returns how many went."""
        over = self.ledger.total + need - self.capacity_bytes
        if over <= 0:
            return 0
        victims = self.ledger.oldest(over, exclude)
        try:
            self.bucket.delete(victims)
        except Exception as e:  # botocore's errors: the room is not made, the save is cut to fit
            logger.warning("evicting %d KV store entries from %s failed: %s", len(victims), self.location, e)
            return 0
        self.ledger.remove(victims)
        return len(victims)

    # ---- load ---------------------------------------------------------------------------
    def load(self, job: LoadJob) -> IOResult:
        out = IOResult(job)
        for slot in job.slots:
            self.pool.buffer[slot].zero_()  # a short object leaves zeros, which its checksum refuses
        read = self.io.read([self._item(s, k) for k, s in zip(job.keys, job.slots)], IO_TIMEOUT_S)
        if read < len(job.keys):
            out.failed = True
            self.ledger.remove([job.keys[read]])
        checks = self._hashers.map(self._check, job.keys[:read], job.slots[:read])
        for key, problem in zip(job.keys, list(checks)):
            if problem is not None:
                self._drop_corrupt(key, problem, out)
                break
            out.ok += 1
        if out.ok:
            hits = job.keys[: out.ok]
            # the most recently used now (and known, if another engine wrote them)
            self.ledger.add(hits, self.pool.frame_bytes)
            self._recent.update(hits)
        out.finished = time.monotonic()
        out.total_bytes = self.ledger.total
        return out

    def _check(self, key: bytes, slot: int) -> str | None:
        return frame.problem(self.pool.frame(slot), key, self.namespace)

    def _drop_corrupt(self, key: bytes, why: str, out: IOResult) -> None:
        logger.warning("KV store entry %s is corrupt (%s): deleted, its blocks are recomputed", key.hex(), why)
        try:
            self.bucket.delete([key])
        except Exception as e:
            logger.warning("deleting corrupt entry %s from %s failed: %s", key.hex(), self.location, e)
        self.ledger.remove([key])
        out.corrupt += 1

    def close(self) -> None:
        self._hashers.shutdown()
        self.io.close()
        self._heads.close()


def check_bucket(config: KVStoreConfig) -> None:
    """Raise StoreUnreachable (a ValueError) unless `config.url`'s bucket answers with these
    credentials and NIXL's OBJ backend starts and reaches it from this process."""
    bucket, prefix = bucket_of(config.url)
    Bucket(bucket, prefix, config.endpoint, config.region).check()
    try:
        probe = NixlObjectIO("kv-store-check", obj_params(bucket, config.endpoint, config.region, dict(os.environ)))
        probe.exists([f"{prefix}check{frame.MAGIC.decode()}"], 1)
        probe.close()
    except (StorageError, ImportError) as e:
        raise StoreUnreachable(f"KV store {config.url}: {e}") from e
