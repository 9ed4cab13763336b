"""L3's index: which entry files a store directory holds, their bytes, their last use.

The entry files are the data (content-addressed, each framed and checksummed); the index beside
them (`index.sqlite3`, SQLite in WAL mode) is what lets several processes share one directory
under one byte limit: every change is one short transaction under SQLite's file lock, and it
answers "which of these keys are stored" for a whole prompt in one query.

An entry is first reserved (a row that is not ready: its file is being written, its bytes already
counted), then published: the finished temporary file is renamed into place inside the
transaction that marks the row ready, so a ready row always has its whole file and a reader never
sees a partial one. Making room evicts the least recently used ready rows and unlinks their files
in that same transaction, before any new byte is written: the entry files never hold more than
the limit. A reservation left by a process that died is reclaimed once it is `stale_s` old.

SQLite's locking needs a filesystem with working POSIX locks (local disks do; some network
filesystems do not): on those, give each host its own directory.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS entries (key BLOB PRIMARY KEY, size INTEGER NOT NULL, "
    "ready INTEGER NOT NULL, used REAL NOT NULL) WITHOUT ROWID",
    "CREATE INDEX IF NOT EXISTS entries_by_use ON entries (ready, used)",
    "CREATE TABLE IF NOT EXISTS totals (name TEXT PRIMARY KEY, value INTEGER NOT NULL)",
    "INSERT OR IGNORE INTO totals VALUES ('bytes', 0)",
)
_BATCH = 500  # keys per IN (...) query, well under SQLite's variable limit
_LOCK_WAIT_S = 30.0


def _enter_wal(db: sqlite3.Connection, path: str) -> None:
    """Switch the file to WAL (once per file: the mode is stored in it).

    The switch needs the exclusive lock, and when several processes open a new directory at once
    SQLite answers a contended switch with "database is locked" at once instead of waiting on its
    busy timeout (it does not wait where waiting could deadlock): so retry, bounded."""
    deadline = time.monotonic() + _LOCK_WAIT_S
    delay = 0.005
    while True:
        try:
            mode = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if str(mode).lower() == "wal":
                return
            raise sqlite3.OperationalError(f"{path}: the filesystem refused WAL mode (journal mode is {mode})")
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) and "busy" not in str(e):
                raise
            if time.monotonic() > deadline:
                raise sqlite3.OperationalError(f"{path}: still locked after {_LOCK_WAIT_S:.0f} s") from e
            time.sleep(delay)
            delay = min(delay * 2, 0.2)


@dataclass
class Reservation:
    keys: list[bytes] = field(default_factory=list)
    """Keys reserved for this caller to write (the others were stored or reserved already)."""
    stored: int = 0
    """Requested keys the index already had."""
    evicted: int = 0
    total_bytes: int = 0


class StoreIndex:
    def __init__(self, directory: str, capacity_bytes: int, path_of: Callable[[bytes], str], stale_s: float = 120.0):
        self.directory = directory
        self.capacity_bytes = capacity_bytes
        self.path_of = path_of
        self.stale_s = stale_s
        self._db_path = os.path.join(directory, "index.sqlite3")
        self._local = threading.local()  # one connection per thread (sqlite3's rule)
        with self._tx() as db:
            for statement in _SCHEMA:
                db.execute(statement)

    def _db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(self._db_path, timeout=_LOCK_WAIT_S, isolation_level=None)
            _enter_wal(db, self._db_path)
            db.execute("PRAGMA synchronous=NORMAL")
            self._local.db = db
        return db

    def _tx(self) -> _Transaction:
        return _Transaction(self._db())

    # ---- reads ------------------------------------------------------------------------
    def ready_keys(self, keys: list[bytes]) -> set[bytes]:
        """Which of `keys` have a published entry."""
        db, found = self._db(), set()
        for i in range(0, len(keys), _BATCH):
            chunk = keys[i : i + _BATCH]
            rows = db.execute(
                f"SELECT key FROM entries WHERE ready = 1 AND key IN ({','.join('?' * len(chunk))})", chunk
            )
            found.update(bytes(r[0]) for r in rows)
        return found

    def count_prefix(self, keys: list[bytes]) -> int:
        """How many of `keys`, from the first, have a published entry (one query per 500 keys)."""
        found, n = self.ready_keys(keys), 0
        while n < len(keys) and keys[n] in found:
            n += 1
        return n

    def total_bytes(self) -> int:
        return int(self._db().execute("SELECT value FROM totals WHERE name = 'bytes'").fetchone()[0])

    # ---- writes -----------------------------------------------------------------------
    def reserve(self, keys: list[bytes], size: int) -> Reservation:
        """Reserve `size` bytes for each key not stored yet, evicting as needed; keys that do not
        fit (every other entry being written) are left out, the latest first."""
        now = time.time()
        out = Reservation()
        with self._tx() as db:
            known = self._known(db, keys)
            new = list(dict.fromkeys(k for k in keys if k not in known))
            out.stored = len(keys) - len(new)
            total = self._total(db)
            need = total + len(new) * size - self.capacity_bytes
            if need > 0:
                freed, out.evicted = self._evict(db, need, now, exclude=set(keys))
                total -= freed
            fit = max(0, min(len(new), (self.capacity_bytes - total) // size))
            out.keys = new[:fit]
            db.executemany("INSERT INTO entries VALUES (?, ?, 0, ?)", [(k, size, now) for k in out.keys])
            out.total_bytes = total + fit * size
            self._set_total(db, out.total_bytes)
        return out

    def publish(self, keys: Iterable[bytes], tmp_path_of: Callable[[bytes], str]) -> list[bytes]:
        """Rename each key's finished temporary file into place and mark it ready; returns the keys
        published (a reservation reclaimed meanwhile loses its file instead)."""
        keys, done = list(keys), []
        now = time.time()
        with self._tx() as db:
            pending = {
                bytes(r[0])
                for chunk in _chunks(keys)
                for r in db.execute(
                    f"SELECT key FROM entries WHERE ready = 0 AND key IN ({','.join('?' * len(chunk))})", chunk
                )
            }
            for key in keys:
                if key in pending:
                    os.replace(tmp_path_of(key), self.path_of(key))
                    done.append(key)
                else:
                    _unlink(tmp_path_of(key))
            db.executemany("UPDATE entries SET ready = 1, used = ? WHERE key = ?", [(now, k) for k in done])
        return done

    def remove(self, keys: Iterable[bytes], files: Iterable[str] = ()) -> None:
        """Drop entries (a corrupt one, a failed write) and their files."""
        keys = list(keys)
        with self._tx() as db:
            freed = 0
            for chunk in _chunks(keys):
                marks = ",".join("?" * len(chunk))
                freed += sum(r[0] for r in db.execute(f"SELECT size FROM entries WHERE key IN ({marks})", chunk))
                db.execute(f"DELETE FROM entries WHERE key IN ({marks})", chunk)
            for path in files:
                _unlink(path)
            self._set_total(db, self._total(db) - freed)

    def touch(self, keys: list[bytes]) -> None:
        """Mark entries used now (a hit): they are the last to be evicted."""
        now = time.time()
        with self._tx() as db:
            db.executemany("UPDATE entries SET used = ? WHERE key = ? AND ready = 1", [(now, k) for k in keys])

    # ---- helpers ----------------------------------------------------------------------
    def _known(self, db: sqlite3.Connection, keys: list[bytes]) -> set[bytes]:
        return {
            bytes(r[0])
            for chunk in _chunks(keys)
            for r in db.execute(f"SELECT key FROM entries WHERE key IN ({','.join('?' * len(chunk))})", chunk)
        }

    def _evict(self, db: sqlite3.Connection, need: int, now: float, exclude: set[bytes]) -> tuple[int, int]:
        """Unlink and delete the least recently used ready entries (and stale reservations) until
        `need` bytes are free; returns (bytes freed, entries evicted)."""
        freed = evicted = 0
        rows = db.execute(
            "SELECT key, size, ready FROM entries WHERE ready = 1 OR used < ? ORDER BY used", (now - self.stale_s,)
        )
        victims = []
        for key, size, ready in rows:
            key = bytes(key)
            if key in exclude:
                continue
            victims.append((key, ready))
            freed += size
            if freed >= need:
                break
        for key, ready in victims:
            _unlink(self.path_of(key) if ready else self.path_of(key) + ".tmp")
            db.execute("DELETE FROM entries WHERE key = ?", (key,))
            evicted += 1
        return freed, evicted

    @staticmethod
    def _total(db: sqlite3.Connection) -> int:
        return int(db.execute("SELECT value FROM totals WHERE name = 'bytes'").fetchone()[0])

    @staticmethod
    def _set_total(db: sqlite3.Connection, value: int) -> None:
        db.execute("UPDATE totals SET value = ? WHERE name = 'bytes'", (value,))

    def close(self) -> None:
        db = getattr(self._local, "db", None)
        if db is not None:
            db.close()
            self._local.db = None


class _Transaction:
    """`BEGIN IMMEDIATE` ... `COMMIT` (or `ROLLBACK` on an error): the writer's lock from the start,
    so two processes never both read the total and then both add to it."""

    def __init__(self, db: sqlite3.Connection):
        self.db = db

    def __enter__(self) -> sqlite3.Connection:
        self.db.execute("BEGIN IMMEDIATE")
        return self.db

    def __exit__(self, kind, value, tb) -> None:
        self.db.execute("COMMIT" if kind is None else "ROLLBACK")


def _chunks(keys: list[bytes]) -> Iterable[list[bytes]]:
    for i in range(0, len(keys), _BATCH):
        yield keys[i : i + _BATCH]


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
