"""The storage index's group commit: the slots' entries as loads see them
(IndexedSlots, a part of SlabStore), the records waiting for the log, and
one thread (Flusher) that writes them every `interval_s`, or sooner once
enough wait (kick); SlabStore.close() commits a last time.

A store is acknowledged when its bytes are in the slab file, before its
index record is on disk; what that costs after a crash is stated in
store.py's docstring.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from kvoffload.tiers.storage.index import OP_FREE, OP_PUT, IndexLog

log = logging.getLogger(__name__)


class Flusher:
    def __init__(self, flush: Callable[[], object], interval_s: float, name: str = "kvoffload-storage-index"):
        self._flush = flush
        self._interval = interval_s
        self._cond = threading.Condition()
        self._kicked = False
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def kick(self) -> None:
        """Flush now rather than at the next tick (enough records wait)."""
        with self._cond:
            self._kicked = True
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._kicked or self._stopping, timeout=self._interval)
                self._kicked = False
                if self._stopping:
                    return
            try:
                self._flush()
            except Exception:  # never let the commit thread die: the next tick tries again
                log.exception("storage index commit failed")

    def stop(self) -> None:
        """Stop the thread (the caller flushes the last records itself)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join()


class IndexedSlots:
    """slot -> (key, checksum) of every stored slot (what loads check
    against, committed or not) and the group commit of its records. Set up
    by SlabStore, which holds the files."""

    entries: dict[int, tuple[bytes, int]]
    index: IndexLog | None
    fds: list[int]
    num_files: int
    commit_records: int

    def _init_entries(self, commit_interval_s: float) -> None:
        self.entries = self.index.entries
        self.bad_index_records = self.index.bad_records
        self._lock = threading.Lock()
        self._commit_lock = threading.Lock()  # one commit (or reset) at a time
        self._pending: list[bytes] = []  # packed records not yet in the log, in order
        self._committing = 0  # records being written by the commit in progress
        self._unwritten = 0  # records of failed commits (the next commit rewrites the log whole)
        self._unsynced: set[int] = set()  # slab fds written since the last commit
        self._commit_failing = False  # warned once until a commit succeeds
        self._corrupt: list[tuple[int, str]] = []  # (slot, counter)
        self._loaded = 0  # blocks of successful loads, counted by the worker
        self._stored = False  # whether any store was recorded since the open
        self._flusher: Flusher | None = Flusher(self.flush, commit_interval_s)

    @property
    def durable(self) -> dict[int, tuple[bytes, int]]:
        """The entries (the name kept for callers of the synchronous index)."""
        return self.entries

    def _stop_flusher(self, commit: bool) -> None:
        if getattr(self, "_flusher", None) is not None:
            self._flusher.stop()
            self._flusher = None
            if commit:
                self.flush()

    def record_stored(self, puts: list[tuple[int, bytes, int]]) -> None:
        """(slot, key, checksum) of slots whose bytes were just written: served
        from now on; their records reach the log with the next commit."""
        pack = self.index.pack
        records = [pack(OP_PUT, s, c, k) for s, k, c in puts]
        with self._lock:
            self._stored = True
            for s, k, c in puts:
                self.entries[s] = (k, c)
                self._unsynced.add(self.fds[s % self.num_files])
            self._pending += records
            full = len(self._pending) >= self.commit_records
        if full and self._flusher is not None:
            self._flusher.kick()

    def flush(self, raise_errors: bool = False) -> bool:
        """One group commit: fdatasync the slab files written since the last
        one, then append the waiting records (or rewrite the log from the
        entries, if it is dirty or due for compaction) and fdatasync it. On
        failure the log is marked dirty (rewritten whole by the next commit);
        False, or the OSError if raise_errors."""
        with self._commit_lock:
            if self.index is None:
                return True
            with self._lock:
                records, self._pending = self._pending, []
                self._committing = len(records)
                fds, self._unsynced = self._unsynced, set()
                whole = self.index.dirty or self.index.needs_compaction(len(self.entries), len(records))
                snapshot = list(self.entries.items()) if whole else None
            if not records and snapshot is None and not fds:
                return True
            try:
                return self._commit(records, fds, snapshot, raise_errors)
            finally:
                with self._lock:
                    self._committing = 0

    @property
    def uncommitted(self) -> int:
        """Index records not on disk yet: what a kill -9 now would cost."""
        with self._lock:
            return len(self._pending) + self._committing + self._unwritten

    def _commit(self, records: list[bytes], fds: set[int], snapshot, raise_errors: bool) -> bool:
        try:
            self.sync_data(fd for fd in fds if fd >= 0)
            if snapshot is not None:
                self.index.rewrite(snapshot)
            elif records:
                self.index.append(b"".join(records))
        except OSError as e:
            self.index.dirty = True  # the entries (these records included) are rewritten next time
            with self._lock:
                self._unwritten += len(records)
            if raise_errors:  # the caller says what it cost
                raise
            if not self._commit_failing:
                log.warning("storage index %s: commit failed (%s): recent stores are misses after a "
                            "crash until a commit succeeds", self.dir, e.strerror or e)
            self._commit_failing = True
            return False
        if snapshot is not None:
            with self._lock:
                self._unwritten = 0
        self._commit_failing = False
        return True

    def expected_checksum(self, slot: int) -> int | None:
        with self._lock:
            entry = self.entries.get(slot)
        return None if entry is None else entry[1]

    def report_corrupt(self, slot: int, counter: str = "checksum_failures") -> None:
        """A slot that is bad (counter says how): dropped, never served again."""
        with self._lock:
            self._corrupt.append((slot, counter))
            self.entries.pop(slot, None)
            self._pending.append(self.index.pack(OP_FREE, slot))

    def take_corrupt(self) -> list[tuple[int, str]]:
        """(slot, counter) of the slots found bad since the last call (for the manager)."""
        if not self._corrupt:
            return []
        with self._lock:
            out, self._corrupt = self._corrupt, []
        return out

    def count_loaded(self, n: int) -> None:
        with self._lock:
            self._loaded += n

    def take_loaded(self) -> int:
        with self._lock:
            n, self._loaded = self._loaded, 0
        return n

    def clear(self) -> None:
        """Forget every entry, on disk too: the log is cut to its header, which
        needs no free space (a reset must hold on a full disk)."""
        with self._commit_lock:
            with self._lock:
                self.entries.clear()
                self._pending.clear()
                self._unwritten = 0
            self.index.void()

    def forget(self, slots: list[int]) -> None:
        """Forget these slots (a reset keeping the rest), on disk too, now. If
        their FREEs cannot be written (a full disk), the log is cut to its
        header instead: the kept entries are then missing on disk (misses
        after a restart, never stale blocks) until the next commit rewrites it."""
        with self._lock:
            held = [s for s in slots if s in self.entries]
            for s in held:
                del self.entries[s]
            self._pending += [self.index.pack(OP_FREE, s) for s in held]
        try:
            self.flush(raise_errors=True)
        except OSError as e:
            with self._commit_lock:
                self.index.void()
                self.index.dirty = True  # put the kept entries back with the next commit
            log.warning("storage index %s: cannot record a cache reset (%s): index emptied on disk instead "
                        "(%d blocks still in use are misses after a restart until the next commit)",
                        self.dir, e.strerror or e, len(self.entries))

    def sync_data(self, fds) -> None:
        """fdatasync the given slab files, concurrently: the filesystem
        journal folds concurrent syncs into one commit."""
        fds = list(fds)
        if len(fds) <= 1:
            for fd in fds:
                os.fdatasync(fd)
            return
        if self._syncer is None:
            self._syncer = ThreadPoolExecutor(self.num_files, thread_name_prefix="kvoffload-storage-sync")
        for f in [self._syncer.submit(os.fdatasync, fd) for fd in fds]:
            f.result()  # re-raises an OSError here

