"""Moves whole chunks between host-pool slots and slab-file slots with
O_DIRECT, on a small pool of IO threads.

Host-pool chunks are page-aligned and a multiple of 4 KiB, so they are read
and written in place (no bounce buffer). A job is split into one task per
IO thread: runs of slots adjacent in a slab file go in one pwritev/preadv.
A store job completes once its bytes are written: its slots'
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

MAX_RUN_BYTES = 4 << 20  # one IO at most: a large job still spreads over the IO threads
MAX_RUN_CHUNKS = 512  # iovecs per IO (IOV_MAX is 1024)


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
        if not slots:
            self._finished.append(TransferResult(job_id, True, 0, 0.0))
            return True
        parts = self._plan(slots)
        job = _Job(job_id, is_store, slots, chunks, keys, len(parts))
        with self._done:
            self._in_flight.add(job_id)
        # a reused slot's old entry stays in the log until this store's is
        # committed: it names the old bytes' checksum, so after a crash the
        # slot is a miss, never the new bytes served as the old key
        for runs in parts:
            self._tasks.put((job, runs))
        return True

    def _plan(self, slots: list[int]) -> list[list[tuple[int, int, list[int]]]]:
        """The job's IO as runs (fd, offset, job indices) of slots adjacent in
        one slab file, one pwritev/preadv each (at most MAX_RUN_BYTES), dealt
        round-robin to at most io_threads parts."""
        size, nf = self.store.slot_bytes, self.store.num_files
        most = max(1, min(MAX_RUN_CHUNKS, MAX_RUN_BYTES // size))
        runs: list[tuple[int, int, list[int]]] = []
        for i in sorted(range(len(slots)), key=lambda i: (slots[i] % nf, slots[i])):
            fd, off = self.store.locate(slots[i])
            if runs and runs[-1][0] == fd and runs[-1][1] + len(runs[-1][2]) * size == off \
                    and len(runs[-1][2]) < most:
                runs[-1][2].append(i)
            else:
                runs.append((fd, off, [i]))
        parts = min(self.io_threads, len(runs))
        return [runs[p::parts] for p in range(parts)]

    def _run(self) -> None:
        while True:
            task = self._tasks.get()
            if task is None:
                return
            job, runs = task
            try:
                self._do_part(job, runs)
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

    def _do_part(self, job: _Job, runs: list[tuple[int, int, list[int]]]) -> None:
        size = self.store.slot_bytes
        for fd, off, idxs in runs:
            if not job.ok:
                return
            bufs = [self.pool.chunk_memoryview(job.chunks[i])[:size] for i in idxs]
            if job.is_store:
                for i, buf in zip(idxs, bufs):
                    job.checksums[i] = self._checksum(buf)
                if os.pwritev(fd, bufs, off) != size * len(bufs):
                    raise OSError(f"short write to storage slots {[job.slots[i] for i in idxs]}")
                continue
            try:
                whole = os.preadv(fd, bufs, off) == size * len(bufs)
            except OSError:
                whole = False
            for k, (i, buf) in enumerate(zip(idxs, bufs)):
                if not whole:  # which slot is short or unreadable: read them one by one
                    self._read_one(job, i, fd, off + k * size, buf)
                elif not self._matches(job, i, buf):
                    self._drop(job, i, "checksum mismatch", "checksum_failures")

    def _read_one(self, job: _Job, i: int, fd: int, off: int, buf: memoryview) -> None:
        try:
            if os.preadv(fd, [buf], off) != len(buf):  # a truncated slab
                return self._drop(job, i, "short read", "load_failures")
        except OSError as e:  # EIO (a bad sector): as unreadable
            return self._drop(job, i, f"read error ({e.strerror or e})", "load_failures")
        if not self._matches(job, i, buf):
            self._drop(job, i, "checksum mismatch", "checksum_failures")

    def _matches(self, job: _Job, i: int, buf: memoryview) -> bool:
        expected = self.store.expected_checksum(job.slots[i])
        return expected is not None and self._checksum(buf) == expected

    def _drop(self, job: _Job, i: int, why: str, counter: str) -> None:
        """A bad slot: dropped, so it answers MISS from now on instead of failing every load."""
        log.warning("storage slot %d: %s, dropped", job.slots[i], why)
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
