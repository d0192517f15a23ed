"""Moves whole chunks between host-pool slots and slab-file slots with
O_DIRECT, on a small pool of IO threads.

Host-pool chunks are page-aligned and a multiple of 4 KiB, so they are read
and written in place (no bounce buffer). A job is split into one task per
IO thread. A store job completes once its bytes are written: its slots'
entries (key, xxh3 of the bytes) are then recorded in the SlabStore, served
from then on, and reach the index log with the store's next group commit
(commit.py; what a crash costs: store.py). No sync sits on a store's path.
A load checks each chunk's xxhash against its entry as it is read; a
mismatch, a short read or a read error fails the job and the slot is
reported bad (a miss from then on, never served). IO errors fail the job
(the tiering manager turns that into a miss or a dropped store) and never
raise into the engine. Loaded blocks are counted here, for successful jobs
only.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque

import xxhash

from kvoffload.abstractions import CPULoadStoreSpec, LoadStoreSpec, TransferResult
from kvoffload.align import align_up
from kvoffload.tiers.base import TierWorker
from kvoffload.tiers.host_pool import HostPool
from kvoffload.tiers.storage.manager import StorageLoadStoreSpec
from kvoffload.tiers.storage.store import SlabStore

log = logging.getLogger(__name__)


class _Job:
    __slots__ = ("job_id", "is_store", "slots", "chunks", "keys", "checksums",
                 "remaining", "ok", "start", "lock")

    def __init__(self, job_id, is_store, slots, chunks, keys, parts):
        self.job_id = job_id
        self.is_store = is_store
        self.slots = slots
        self.chunks = chunks
        self.keys = keys
        self.checksums = [0] * len(slots)
        self.remaining = parts
        self.ok = True
        self.start = time.perf_counter()
        self.lock = threading.Lock()


class StorageWorker(TierWorker):
    def __init__(self, store: SlabStore, pool: HostPool, io_threads: int = 4):
        # a pool slot may be longer (trailer room another tier keeps after the chunk): only its first
        # slot_bytes are written and read, so the files' format does not depend on the other tiers
        if store.slot_bytes != align_up(pool.used_chunk_bytes):
            raise ValueError(f"host pool chunks are {pool.used_chunk_bytes} bytes but storage slots "
                             f"are {store.slot_bytes}: build both from the same chunk size")
        self.store = store
        self.pool = pool
        # a slot's padding after the chunk is hashed as zeros: another tier (Mooncake's trailer) may
        # write there while this tier stores the slot; with no such writer it is zeros anyway, so
        # files written before are read the same
        self._used = pool.used_chunk_bytes
        self._zeros = bytes(store.slot_bytes - self._used)
        self.io_threads = max(1, io_threads)
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._finished: deque[TransferResult] = deque()
        self._done = threading.Condition()
        self._in_flight: set[int] = set()
        self._threads = [threading.Thread(target=self._run, name=f"kvoffload-storage-io-{i}",
                                          daemon=True) for i in range(self.io_threads)]
        for t in self._threads:
            t.start()

    # --- TierWorker ---

    def submit_store(self, job_id: int, src: CPULoadStoreSpec, dst: LoadStoreSpec) -> bool:
        """Write host chunks src to the slots of dst (a StorageLoadStoreSpec
        carrying the keys, which the index records)."""
        assert isinstance(dst, StorageLoadStoreSpec) and dst.keys is not None
        return self._submit(job_id, True, dst.block_ids, src.block_ids, dst.keys)

    def submit_load(self, job_id: int, src: LoadStoreSpec, dst: CPULoadStoreSpec) -> bool:
        assert isinstance(src, StorageLoadStoreSpec)
        return self._submit(job_id, False, src.block_ids, dst.block_ids, None)

    def get_finished(self) -> list[TransferResult]:
        out = []
        while self._finished:
            out.append(self._finished.popleft())
        return out

    def wait(self, job_ids: set[int]) -> None:
        with self._done:
            self._done.wait_for(lambda: not (job_ids & self._in_flight))

    @property
    def queue_depth(self) -> int:
        return len(self._in_flight)

    def shutdown(self) -> None:
        with self._done:
            self._done.wait_for(lambda: not self._in_flight, timeout=60)
        for _ in range(self.io_threads):
            self._tasks.put(None)
        for t in self._threads:
            t.join(timeout=30)

    # --- internals ---

    def _submit(self, job_id, is_store, slots, chunks, keys) -> bool:
        if len(slots) != len(chunks):
            raise ValueError(f"job {job_id}: {len(slots)} storage slots for {len(chunks)} host chunks")
        slots = [int(s) for s in slots]
        chunks = [int(c) for c in chunks]
        parts = min(self.io_threads, len(slots))
        if parts == 0:
            self._finished.append(TransferResult(job_id, True, 0, 0.0))
            return True
        job = _Job(job_id, is_store, slots, chunks, keys, parts)
        with self._done:
            self._in_flight.add(job_id)
        # a reused slot's old entry stays in the log until this store's is
        # committed: it names the old bytes' checksum, so after a crash the
        # slot is a miss, never the new bytes served as the old key
        for p in range(parts):
            self._tasks.put((job, p))
        return True

    def _run(self) -> None:
        while True:
            task = self._tasks.get()
            if task is None:
                return
            job, part = task
            try:
                self._do_part(job, part)
            except OSError as e:
                log.warning("storage job %d failed: %s", job.job_id, e)
                job.ok = False
            except Exception:  # never let an IO thread die
                log.exception("storage job %d failed", job.job_id)
                job.ok = False
            with job.lock:
                job.remaining -= 1
                last = job.remaining == 0
            if last:
                if job.is_store and job.ok:
                    self.store.record_stored(list(zip(job.slots, job.keys, job.checksums)))
                self._finish(job)

    def _do_part(self, job: _Job, part: int) -> None:
        n = len(job.slots)
        parts = min(self.io_threads, n)
        lo, hi = part * n // parts, (part + 1) * n // parts
        size = self.store.slot_bytes
        for i in range(lo, hi):
            if not job.ok:
                return
            fd, off = self.store.locate(job.slots[i])
            buf = self.pool.chunk_memoryview(job.chunks[i])[:size]
            if job.is_store:
                job.checksums[i] = self._checksum(buf)
                if os.pwritev(fd, [buf], off) != size:
                    raise OSError(f"short write to storage slot {job.slots[i]}")
            else:
                expected = self.store.expected_checksum(job.slots[i])
                bad = None
                try:
                    if os.preadv(fd, [buf], off) != size:  # a truncated slab
                        bad, counter = "short read", "load_failures"
                except OSError as e:  # EIO (a bad sector): as unreadable
                    bad, counter = f"read error ({e.strerror or e})", "load_failures"
                if bad is None and (expected is None or self._checksum(buf) != expected):
                    bad, counter = "checksum mismatch", "checksum_failures"
                if bad is not None:  # dropped, so it answers MISS from now on instead of failing every load
                    log.warning("storage slot %d: %s, dropped", job.slots[i], bad)
                    self.store.report_corrupt(job.slots[i], counter)
                    job.ok = False

    def _checksum(self, buf: memoryview) -> int:
        """xxh3 of the chunk followed by zeros to the slot's end (the padding may hold another tier's bytes)."""
        if not self._zeros:
            return xxhash.xxh3_64_intdigest(buf)
        h = xxhash.xxh3_64()
        h.update(buf[: self._used])
        h.update(self._zeros)
        return h.intdigest()

    def _finish(self, job: _Job) -> None:
        nbytes = len(job.slots) * self.store.slot_bytes if job.ok else 0
        if job.ok and not job.is_store:
            self.store.count_loaded(len(job.slots))
        self._finished.append(TransferResult(job.job_id, job.ok, nbytes,
                                             time.perf_counter() - job.start))
        with self._done:
            self._in_flight.discard(job.job_id)
            self._done.notify_all()
