"""The CPU executor of copy plans: KV tensors in host memory.

One transfer thread copies each job with a small C extension (_memcopy.c,
built at install by setup.py): a memmove per range (streaming stores,
which bypass the cache, for aligned ranges from 128 KiB), the whole job
without the GIL (docs/BENCHMARKS.md "Copy bandwidth"). Where no ref is strided, the
extension also computes the job's addresses (copy_blocks: one call per KV
group, from the planner's pieces, the GPU blocks and the pool slots; after
a large copy the caches are cold and each numpy call of the planner costs
~10 us); else (or for a store into a pool the TP ranks share, whose
writer filter is the planner's) the plan (plan.py) goes in as its arrays.
Without it (no compiler at install, or KVOFFLOAD_NATIVE_COPY=0) the
fallback calls libc memmove per range through ctypes, giving up the GIL
around one range per GIL_EVERY bytes (each time it takes it back it may
wait for another thread), and copies a job of many small ranges (mean
below GATHER_BELOW: 1 KiB blocks in 4 KiB pool chunks never merge) as one
numpy gather/scatter per tensor over views of records of the range size.
A strided ref is copied as one np.copyto per stretch of its numpy strided
views (all blocks x fragments; all slots x pages x fragments). Nothing
else on the copy path allocates beyond the plan's few small arrays.
A caller with nothing to overlap the copies with may have them run in its
own thread instead (run_inline: the same plan and copy, no hand-offs), and
a caller about to block on queued jobs (wait) copies them itself.
"""

from __future__ import annotations

import ctypes
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from kvoffload.abstractions import CanonicalKVCaches
from kvoffload.tiers.cpu.plan import (
    STORE, CopyPlanner, GroupJob, Plan, StridedRef, _memcopy, base_addresses, native_module)
from kvoffload.tiers.host_pool import HostPool

logger = logging.getLogger(__name__)

# The fallback's, without the extension (whose one call per job is 2-8x
# faster than this gather for jobs of 8-256 ranges of 1-32 KiB). A job of
# at least GATHER_MIN_RANGES ranges of mean size below GATHER_BELOW is one
# gather/scatter instead of a memmove per range: per job of 1,024 ranges,
# 5.5x faster at 1 KiB, 1.7x at 4 KiB, even at 16 KiB, slower from 32 KiB
# (numpy's gather goes through a temporary; docs/BENCHMARKS.md).
GATHER_BELOW = 8 * 1024
GATHER_MIN_RANGES = 16

# The fallback's memmove loop gives up the GIL (and must take it back)
# around one memmove per GIL_EVERY bytes, not around each range (the
# extension gives it up once per job): a thread that takes the GIL back
# while another holds it waits for a hand-off, tens of us here against 25 us
# for a 256 KiB copy. 1 MiB: other threads wait at most ~0.1 ms of copying.
# A caller copying the jobs it waits for (poll with block_on) keeps it for
# WAITER_GIL_EVERY: it blocks anyway, and the copy thread it woke then finds
# the GIL free less often while the caller copies (+3-14% at 64-256 KiB).
GIL_EVERY = 1 << 20
WAITER_GIL_EVERY = 8 << 20


def _memmove_keeping_gil():
    """libc's memmove called without giving up the GIL (ctypes.PyDLL), or
    None where the process's own symbols cannot be opened."""
    try:
        f = ctypes.PyDLL(None).memmove
    except (OSError, AttributeError):
        return None
    f.argtypes, f.restype = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t), ctypes.c_void_p
    return f


_MEMMOVE_KEEPING_GIL = _memmove_keeping_gil()
if _MEMMOVE_KEEPING_GIL is None:
    GIL_EVERY = 0


def native_copy():
    """The extension's copy (a job's ranges in one call, without the GIL),
    or None: not built, or KVOFFLOAD_NATIVE_COPY=0 (tests, benchmarks)."""
    native = native_module()
    return None if native is None else native.copy


Finish = Callable[[int, int, "float | None"], None]  # (job id, bytes or -1 if failed, seconds)


class BlockJob(NamedTuple):
    """A job the extension plans and copies itself (copy_blocks), in place
    of the planner's Plan: no strided refs, nothing to filter by writer."""

    job_id: int
    direction: str
    groups: list[GroupJob]
    nbytes: int


class CPUCopier:
    """Runs plans on one transfer thread; reports each job through `finish`.

    Jobs run one at a time, in submission order, under `_running`: on the
    thread, or in a caller that is about to block on some of them (poll
    with block_on: the worker's wait()), which copies the queued jobs up to
    its last one itself instead of sleeping while the thread is woken and
    then waking it back (two thread hand-offs per wait, 4-9% of a 32 MiB
    batch here; SGLang's tier I/O waits on every job).
    """

    def __init__(self, planner: CopyPlanner, kv_caches: CanonicalKVCaches, pool: HostPool, finish: Finish):
        self.planner, self.pool, self._finish = planner, pool, finish
        self._gpu_base, self._pool_base = base_addresses(kv_caches, pool)
        # byte views from each tensor's block 0 (a plan's offsets count from there) and of the pool
        self._gpu_bytes = [_bytes_at(kvt.tensor) for kvt in kv_caches.tensors]
        self._pool_bytes = pool.array.reshape(-1)
        self._windows: dict[tuple[int, int], np.ndarray] = {}  # (tensor or -1 for the pool, bytes) -> view
        self._views: dict[StridedRef, list[tuple[np.ndarray, np.ndarray]]] = {
            st: self._run_views(kv_caches, st, planner.blocks_per_chunk[g])
            for g, sts in enumerate(planner.strided) for st in sts
        }
        self._native = native_copy()
        # per group, its pieces as copy_blocks' rows: a job is then planned and copied in one C call
        # per group; only without strided refs (those are numpy views, copied from a plan)
        self._rows = None
        if self._native is not None and not any(planner.strided):
            self._rows = [np.ascontiguousarray(np.stack(
                [self._gpu_base[p.tensor_idx] + p.src_offset, p.block_stride, p.chunk_offset, p.page_in_chunk,
                 p.size], axis=1).reshape(-1, 5), dtype=np.int64) for p in planner.pieces]
        self._gil_every = GIL_EVERY  # of the job being copied (_do sets it; the fallback's)
        self._jobs: deque[tuple] = deque()  # submitted, not started: (job id, direction, groups)
        self._running = threading.Lock()  # held by whoever takes and copies jobs: one at a time, in order
        # True: wake the thread up (it takes every queued job); False: stop
        self._wake: queue.SimpleQueue[bool] = queue.SimpleQueue()
        self._awake = False  # a wake-up is due or the thread is on the jobs (fewer wake-ups: one per burst)
        self._lock = threading.Lock()  # guards _awake against the queue emptying; orders submits against close
        self._stopped = False
        self._thread: threading.Thread | None = threading.Thread(
            target=self._run, name="kvoffload-cpu-copy", daemon=True)
        self._thread.start()

    def submit(self, job_id: int, direction: str, groups: list[GroupJob]) -> None:
        """Queue a checked job; one that races close fails (never hangs).
        Inline (run_inline): copy it now, in the caller's thread."""
        with self._lock:
            if not self._stopped:
                if self._thread is None:
                    self._do(job_id, direction, groups)
                else:
                    self._jobs.append((job_id, direction, groups))
                    if not self._awake:
                        self._awake = True
                        self._wake.put(True)
                return
        self._finish(job_id, -1, None)

    def run_inline(self) -> None:
        """From now on copy each job in the thread that submits it, before
        submit returns; the job is still reported through finish (the
        worker's get_finished). Same plan and copy code, no thread
        hand-offs: for a caller with nothing to overlap the copies with (a
        replay on CPU tensors, where two hand-offs per job cost more than
        the copy). Jobs queued before are finished first."""
        with self._lock:
            thread, self._thread = self._thread, None
            if thread is not None:
                self._wake.put(False)
        if thread is not None:
            thread.join()

    def poll(self, block_on: set[int] | None = None) -> None:
        """The thread reports jobs as they finish. A caller about to block
        on jobs still queued copies them (and the jobs queued before them)
        itself, unless the thread is copying already."""
        if not block_on or not self._jobs or not self._running.acquire(blocking=False):
            return
        try:
            left = block_on.intersection([job[0] for job in list(self._jobs)])
            while left and self._jobs:
                job = self._jobs.popleft()
                left.discard(job[0])
                self._do(*job, gil_every=WAITER_GIL_EVERY)
        finally:
            self._running.release()
            with self._lock:  # the thread gave up the jobs to us: hand back what is left
                if self._jobs:
                    self._wake.put(True)
                else:
                    self._awake = False

    def close(self, in_flight: set[int]) -> None:
        """Finish the queued jobs, then stop the thread."""
        with self._lock:
            self._stopped = True
            thread = self._thread
            if thread is not None:
                self._wake.put(False)
        if thread is not None:
            thread.join()

    def _run(self) -> None:
        while self._wake.get():
            # a helper copying: leave the jobs to it (it wakes us for the rest)
            # rather than sleep on the lock and be woken for nothing
            if self._running.acquire(blocking=False):
                try:
                    self._drain(idle=True)
                finally:
                    self._running.release()
        with self._running:  # jobs queued before the stop token; a helper may be at work: wait
            self._drain(idle=False)

    def _drain(self, idle: bool) -> None:
        """Copy the queued jobs in order; idle: then go back to sleep
        (the next submit wakes the thread)."""
        while True:
            with self._lock:
                if not self._jobs:
                    if idle:
                        self._awake = False
                    return
                job = self._jobs.popleft()
            self._do(*job)

    def _do(self, job_id: int, direction: str, groups: list[GroupJob], gil_every: int | None = None) -> None:
        """Plan, copy and report one job; gil_every: bytes copied between
        two gives of the GIL (GIL_EVERY if None)."""
        t0 = time.perf_counter()
        try:
            plan = self._plan(job_id, direction, groups)
            self._gil_every = GIL_EVERY if gil_every is None or not GIL_EVERY else gil_every
            self.copy(plan)
        except Exception:  # a failed job never takes the thread down
            logger.exception("CPU offload %s job %d failed", direction, job_id)
            self._finish(job_id, -1, time.perf_counter() - t0)
        else:
            self._finish(job_id, plan.nbytes, time.perf_counter() - t0)

    def _plan(self, job_id: int, direction: str, groups: list[GroupJob]) -> Plan | BlockJob:
        """The planner's numpy plan, or a BlockJob where the extension can
        plan the job itself: Python run right after a large copy finds the
        caches cold (a 32-chunk job's numpy plan took 80-180 us there, 12 us
        warm). Not for a store into a pool the TP ranks share (a rank writes
        only the blocks it is the writer of: the planner filters them)."""
        if self._rows is None or (direction == STORE and self.planner.shared_pool):
            return self.planner.plan(job_id, direction, groups)
        pieces = self.planner.pieces
        return BlockJob(job_id, direction, groups, sum([len(b) * pieces[g].total for g, b, _, _ in groups]))

    def _copy_blocks(self, job: BlockJob) -> None:
        """One copy_blocks call per group: the plan's addresses, unmerged
        (a memmove call costs ~10 ns in C)."""
        store, pool = job.direction == STORE, self._pool_base
        slot_bytes, k = self.planner.slot_bytes, self.planner.blocks_per_chunk
        for g, blocks, slots, skip in job.groups:
            _memcopy.copy_blocks(store, self._rows[g], pool, slot_bytes, k[g], skip, blocks, slots)

    def _run_views(self, kv_caches: CanonicalKVCaches, st: StridedRef, k: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per CopyRun of a strided ref: its fragments in every GPU block,
        (blocks, fragments, words), and in every pool page, (slots, pages,
        fragments, words), as numpy views; words of the widest int that
        every offset and stride allows (wide elements copy faster)."""
        t = kv_caches.tensors[st.ref.tensor_idx].tensor
        gpu_flat = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).numpy()
        pool_flat = self.pool.array.reshape(-1)
        g_at, g_stride = t.storage_offset(), t.stride(0)
        cb, views = self.pool.chunk_bytes, []
        for r in st.ref.mapping.runs:
            w = math.gcd(8, g_at + r.local_offset, g_stride, r.local_stride, r.fragment_size, cb,
                         st.chunk_offset + r.canonical_offset, st.page_in_chunk, r.canonical_stride)
            dt = np.dtype(f"i{w}") if w > 1 else np.dtype(np.uint8)
            frag = (r.num_fragments, r.fragment_size // w)
            gv = np.ndarray((t.shape[0], *frag), dt, gpu_flat, g_at + r.local_offset,
                            (g_stride, r.local_stride, w))
            pv = np.ndarray((self.pool.num_chunks, k, *frag), dt, pool_flat, st.chunk_offset + r.canonical_offset,
                            (cb, st.page_in_chunk, r.canonical_stride, w))
            views.append((gv, pv))
        return views

    def copy(self, plan: Plan | BlockJob) -> None:
        """The whole CPU copy path: the byte ranges (one call to the
        extension, or the fallback's), np.copyto each stretch of a strided
        ref; or a BlockJob's copy_blocks calls."""
        if isinstance(plan, BlockJob):
            self._copy_blocks(plan)
            return
        if self._native is not None:
            self._copy_native(plan)
        else:
            self._copy_fallback(plan)
        copyto = np.copyto
        for st, stretches in plan.strided:
            for gv, pv in self._views[st]:
                if plan.direction == STORE:
                    for g, p, _ in stretches:
                        copyto(pv[p], gv[g])
                else:
                    for g, p, _ in stretches:
                        copyto(gv[g], pv[p])

    def _copy_native(self, plan: Plan) -> None:
        """All of a plan's ranges in one call to the extension."""
        if len(self._gpu_base) == 1:  # one tensor: its offsets as they are
            g_base, g_off = int(self._gpu_base[0]), plan.gpu_offset
        else:
            g_base, g_off = 0, self._gpu_base[plan.tensor_idx] + plan.gpu_offset
        if plan.direction == STORE:
            self._native(self._pool_base, plan.pool_offset, g_base, g_off, plan.size)
        else:
            self._native(g_base, g_off, self._pool_base, plan.pool_offset, plan.size)

    def _copy_fallback(self, plan: Plan) -> None:
        """Without the extension: a memmove per range through ctypes, or a
        gather for a job of many small ones."""
        n = len(plan.size)
        ranged = int(plan.size.sum()) if plan.strided else plan.nbytes  # bytes of the ranges
        if n >= GATHER_MIN_RANGES and ranged < GATHER_BELOW * n:
            self._gather(plan)
            return
        every = self._gil_every
        if every and ranged < every:  # a small job: the GIL kept throughout
            keeping = _MEMMOVE_KEEPING_GIL
            for dst, src, size in plan.ranges(self._gpu_base, self._pool_base):
                keeping(dst, src, size)
        else:  # the GIL given up around one range per `every` bytes (0: no keeping memmove here, each)
            releasing, keeping, since = ctypes.memmove, _MEMMOVE_KEEPING_GIL, 0
            for dst, src, size in plan.ranges(self._gpu_base, self._pool_base):
                since += size
                if since >= every:
                    releasing(dst, src, size)
                    since = 0
                else:
                    keeping(dst, src, size)

    def _window(self, which: int, size: int) -> np.ndarray:
        """A tensor's (or the pool's, which=-1) bytes as overlapping records
        of `size` bytes, one starting at every byte: indexing it by byte
        offsets gathers whole ranges, one memcpy each inside numpy."""
        v = self._windows.get((which, size))
        if v is None:
            b = self._pool_bytes if which < 0 else self._gpu_bytes[which]
            v = self._windows[which, size] = np.ndarray((len(b) - size + 1,), f"V{size}", b, 0, (1,))
        return v

    def _gather(self, plan: Plan) -> None:
        """Copy a plan's byte ranges as one fancy-index copy per tensor and
        range size (a plan lists one tensor's ranges together; sizes are
        nearly always all equal)."""
        tidx, goff, poff, size = plan.tensor_idx, plan.gpu_offset, plan.pool_offset, plan.size
        cuts = [0, *(np.flatnonzero(tidx[1:] != tidx[:-1]) + 1).tolist(), len(size)]
        for a, b in zip(cuts[:-1], cuts[1:]):
            t, g, p, s = int(tidx[a]), goff[a:b], poff[a:b], size[a:b]
            first = int(s[0])
            by_size = [(first, slice(None))] if (s == first).all() else [(int(x), s == x) for x in np.unique(s)]
            for n, pick in by_size:
                gv, pv = self._window(t, n), self._window(-1, n)
                gp = g[pick]
                k, g0 = len(gp), int(gp[0])
                d = int(gp[1]) - g0 if k > 2 else 0
                if d >= n and int(gp[-1]) - g0 == (k - 1) * d and (np.diff(gp) == d).all():
                    # consecutive blocks (the replay's GPU hands them out so): a strided view, no gather here
                    gp = slice(g0, g0 + k * d, d)
                if plan.direction == STORE:
                    pv[p[pick]] = gv[gp]
                else:
                    gv[gp] = pv[p[pick]]


def _bytes_at(t: torch.Tensor) -> np.ndarray:
    """The bytes of t's storage from t's first element on, as uint8."""
    flat = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).numpy()
    return flat[t.storage_offset() * t.element_size():]
