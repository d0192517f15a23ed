"""The CPU tier's worker: copies KV pages between the engine's KV cache
tensors and the host pool, asynchronously.

Chunk layout inside a pool slot of a key of group g: for each ref of
group_data_refs[g] in order, gpu_blocks_per_chunk(g) pages of that ref,
back to back. A ref with a CanonicalPageMapping stores canonical pages
(canonical_page_size_bytes each). A pool of this rank's own gets all of
its fragments. The TP ranks of a node may instead share one HostPool
(`pool=`, every ref canonical): a chunk then holds whole canonical pages,
a rank stores only the blocks it is the writer of (`is_writer`), and
every rank loads its part (see kvoffload/layout.py).

A mapped page whose fragments merge into one range is a plain "piece"
(_group_pieces). Otherwise, on CPU, each CopyRun is a pair of numpy
strided views (all blocks x fragments; all slots x pages x fragments),
and a job copies one view slice per stretch of blocks whose ids and pool
positions advance by a constant step (_strided_stretches): one np.copyto
per block at worst instead of one memmove per fragment. On CUDA every
fragment is one more piece.

Every job becomes a *plan*: flat arrays of (tensor index, byte offset in
that tensor, byte offset in the pool, bytes), built with a few numpy ops
from per-piece offsets precomputed at start, with neighbouring ranges
merged. Executing a plan is one loop and touches no allocator:
- CPU tensors: one transfer thread plans each job and runs ctypes.memmove
  over raw addresses (memmove releases the GIL; it beat copy_ loops and
  index_select/index_copy_ here, see docs/BENCHMARKS.md). The thread takes
  the GIL back between ranges, so merged, large ranges matter;
- CUDA tensors: non_blocking copy_ of byte views on the worker's own store
  and load streams (after waiting on the compute stream's event); a job is
  done when its end event completes.
"""

from __future__ import annotations

import ctypes
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from kvoffload.abstractions import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from kvoffload.config import OffloadingConfig
from kvoffload.layout import check_config_offloadable, check_shareable
from kvoffload.tiers.base import HostPool

logger = logging.getLogger(__name__)

STORE, LOAD = "store", "load"


def page_bytes_in_chunk(ref: CanonicalKVCacheRef) -> int:
    """Bytes one page of this ref takes in a chunk (canonical if mapped)."""
    return ref.mapping.canonical_page_size_bytes if ref.mapping is not None else ref.page_size_bytes


def chunk_layout(
    kv_caches: CanonicalKVCaches, config: OffloadingConfig
) -> tuple[list[list[tuple[CanonicalKVCacheRef, int]]], int]:
    """Per group, each ref with its byte offset inside a chunk; and the
    chunk size (the largest group's chunk)."""
    if len(kv_caches.group_data_refs) != len(config.groups):
        raise ValueError(
            f"kv caches have {len(kv_caches.group_data_refs)} KV groups, "
            f"the config has {len(config.groups)}"
        )
    layout, chunk_bytes = [], 0
    for g, refs in enumerate(kv_caches.group_data_refs):
        tpb = config.groups[g].tokens_per_block
        if tpb > config.tokens_per_chunk:
            raise ValueError(
                f"groups[{g}].tokens_per_block={tpb} is larger than a chunk "
                f"({config.tokens_per_chunk} tokens): the CPU worker cannot split GPU blocks"
            )
        k = config.gpu_blocks_per_chunk(g)
        offset, group_layout = 0, []
        for ref in refs:
            group_layout.append((ref, offset))
            offset += k * page_bytes_in_chunk(ref)
        layout.append(group_layout)
        chunk_bytes = max(chunk_bytes, offset)
    if chunk_bytes == 0:
        raise ValueError("kv caches have no pages to offload (no refs in any group)")
    return layout, chunk_bytes


@dataclass
class _Pieces:
    """One group's copy pieces: every (ref, fragment) as parallel arrays.
    An unmapped ref is one piece (its whole page); a mapped ref is one
    piece per CopyRun fragment."""

    tensor_idx: np.ndarray  # which kv tensor
    src_offset: np.ndarray  # byte offset of the piece inside a GPU page
    block_stride: np.ndarray  # bytes between GPU blocks of that tensor
    chunk_offset: np.ndarray  # byte offset of the piece's first page in a chunk
    page_in_chunk: np.ndarray  # bytes between sub-block pages in a chunk
    size: np.ndarray  # bytes
    num_writers: np.ndarray  # ranks holding the piece's bytes (1 if unmapped)
    writer_index: np.ndarray  # this rank's turn among them
    min_blocks: int  # block ids must be below this


@dataclass
class _Strided:
    """A mapped ref copied through strided views (CPU only)."""

    ref: CanonicalKVCacheRef
    chunk_offset: int  # of its first page in a chunk
    page_in_chunk: int  # bytes between its pages in a chunk
    views: list[tuple[np.ndarray, np.ndarray]] | None = None  # per run: (GPU, pool); set at start


def _group_pieces(kv_caches: CanonicalKVCaches, layout, group: int,
                  strided: list[_Strided] | None = None) -> _Pieces:
    """The group's pieces. With `strided`, mapped refs of several fragments
    go there instead of becoming one piece per fragment."""
    cols: list[tuple[int, int, int, int, int, int, int, int]] = []
    min_blocks = None
    for ref, offset in layout[group]:
        if not 0 <= ref.tensor_idx < len(kv_caches.tensors):
            raise ValueError(f"ref of group {group} names tensor {ref.tensor_idx}, "
                             f"but there are {len(kv_caches.tensors)}")
        kvt = kv_caches.tensors[ref.tensor_idx]
        t = kvt.tensor
        stride = t.stride(0) * t.element_size()
        if ref.page_size_bytes > kvt.page_size_bytes or kvt.page_size_bytes > stride:
            raise ValueError(
                f"tensor {ref.tensor_idx}: ref page {ref.page_size_bytes} B, tensor page "
                f"{kvt.page_size_bytes} B, block stride {stride} B do not nest"
            )
        min_blocks = t.shape[0] if min_blocks is None else min(min_blocks, t.shape[0])
        page = page_bytes_in_chunk(ref)
        if ref.mapping is None:
            cols.append((ref.tensor_idx, 0, stride, offset, page, ref.page_size_bytes, 1, 0))
            continue
        fragments = []  # (local offset, canonical offset, size)
        for run in ref.mapping.runs:
            for i in range(run.num_fragments):
                lo = run.local_offset + i * run.local_stride
                co = run.canonical_offset + i * run.canonical_stride
                if lo + run.fragment_size > ref.page_size_bytes or co + run.fragment_size > page:
                    raise ValueError(f"tensor {ref.tensor_idx}: CopyRun {run} leaves the page")
                if fragments and fragments[-1][0] + fragments[-1][2] == lo and fragments[-1][1] + fragments[-1][2] == co:
                    fragments[-1] = (fragments[-1][0], fragments[-1][1], fragments[-1][2] + run.fragment_size)
                else:  # not contiguous with the previous one on both sides
                    fragments.append((lo, co, run.fragment_size))
        m = ref.mapping
        if strided is not None and len(fragments) > 1:
            strided.append(_Strided(ref, offset, page))
            continue
        cols += [(ref.tensor_idx, lo, stride, offset + co, page, n, m.num_writers, m.writer_index)
                 for lo, co, n in fragments]
    arr = np.array(cols, dtype=np.int64).reshape(-1, 8).T
    return _Pieces(*arr, min_blocks=min_blocks or 0)


def _span(start: int, step: int, n: int) -> slice:
    """n indices from start by step (a stop below 0 would count from the end)."""
    stop = start + step * n
    return slice(start, stop if stop >= 0 else None, step)


def _strided_stretches(b: np.ndarray, s: np.ndarray, u: np.ndarray) -> list[tuple]:
    """Split a job's (GPU block, pool slot, page in slot) triples into
    stretches that advance by one constant step, the block by a nonzero one
    and either the slot or the page (a numpy slice can take only one):
    (index into a GPU view, index into a pool view, number of blocks)."""
    n = len(b)
    if n == 0:
        return []
    db, ds, du = np.diff(b), np.diff(s), np.diff(u)
    ok = (db != 0) & ((ds != 0) != (du != 0))
    same = np.zeros(max(n - 1, 0), dtype=bool)  # transition t continues transition t-1
    same[1:] = ok[1:] & (db[1:] == db[:-1]) & (ds[1:] == ds[:-1]) & (du[1:] == du[:-1])
    breaks = np.flatnonzero(~same).tolist() + [n - 1]  # where a stretch must stop
    b, s, u = b.tolist(), s.tolist(), u.tolist()
    ok, db, ds, du = ok.tolist(), db.tolist(), ds.tolist(), du.tolist()
    out, i, k = [], 0, 0
    while i < n:
        if i == n - 1 or not ok[i]:
            out.append((b[i], (s[i], u[i]), 1))
            i += 1
            continue
        while breaks[k] <= i:
            k += 1
        m = breaks[k] - i + 1  # elements i..breaks[k]: transitions i..breaks[k]-1 are alike
        pool = (s[i], _span(u[i], du[i], m)) if du[i] else (_span(s[i], ds[i], m), u[i])
        out.append((_span(b[i], db[i], m), pool, m))
        i += m
    return out


def _merge_neighbours(tidx, gpu, pool, size):
    """Merge ranges that continue the previous one on both sides."""
    if len(size) <= 1:
        return tidx, gpu, pool, size
    cont = (
        (gpu[1:] == gpu[:-1] + size[:-1])
        & (pool[1:] == pool[:-1] + size[:-1])
        & (tidx[1:] == tidx[:-1])
    )
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    return tidx[starts], gpu[starts], pool[starts], np.add.reduceat(size, starts)


@dataclass
class _Job:
    job_id: int
    direction: str
    tensor_idx: np.ndarray
    gpu_offset: np.ndarray
    pool_offset: np.ndarray
    size: np.ndarray
    nbytes: int
    strided: list[tuple[_Strided, list[tuple]]]  # each strided ref with its stretches


class CPUOffloadingWorker(OffloadingWorker):
    """Moves chunks between the engine's KV caches and a HostPool it owns."""

    def __init__(self, kv_caches: CanonicalKVCaches, config: OffloadingConfig, num_chunks: int,
                 pool: HostPool | None = None):
        """`pool`: a HostPool shared with the other TP ranks of this node
        (every ref must then be parallelism-agnostic); None: one of our own."""
        check_config_offloadable(config)
        self.kv_caches = kv_caches
        self.config = config
        self.layout, self.chunk_bytes = chunk_layout(kv_caches, config)
        for i, kvt in enumerate(kv_caches.tensors):
            t = kvt.tensor
            if t.element_size() != 1 or t.dim() < 2 or not t[0].is_contiguous():
                raise ValueError(
                    f"kv tensor {i} must be a 1-byte (num_blocks, page bytes) view with contiguous "
                    f"pages, got {t.dtype} {tuple(t.shape)} strides {t.stride()} "
                    "(kvoffload.kv_caches.make_kv_caches builds one)"
                )
        devices = {kvt.tensor.device for kvt in kv_caches.tensors}
        if len(devices) > 1:
            raise ValueError(f"kv tensors are on several devices: {sorted(map(str, devices))}")
        self.device = devices.pop() if devices else torch.device("cpu")
        self.use_cuda = self.device.type == "cuda"
        self._strided: list[list[_Strided]] = [[] for _ in self.layout]
        self._pieces = [_group_pieces(kv_caches, self.layout, g, None if self.use_cuda else self._strided[g])
                        for g in range(len(self.layout))]
        self._block_factor = [config.gpu_blocks_per_chunk(g) for g in range(len(self.layout))]
        self._min_blocks = []  # per group: block ids must be below this
        for p, sts in zip(self._pieces, self._strided):
            limits = [p.min_blocks] if len(p.size) else []
            limits += [kv_caches.tensors[st.ref.tensor_idx].tensor.shape[0] for st in sts]
            self._min_blocks.append(min(limits, default=0))
        # Writers take turns only in a shared pool: in a private one each
        # rank must write everything it will load back.
        self.shared_pool = pool is not None
        if pool is not None:
            check_shareable(kv_caches)
            if pool.num_chunks < num_chunks or pool.chunk_bytes < self.chunk_bytes:
                raise ValueError(f"shared pool has {pool.num_chunks} chunks of {pool.chunk_bytes} B; "
                                 f"need {num_chunks} of {self.chunk_bytes} B")
        try:
            self.pool = pool if pool is not None else HostPool(num_chunks, self.chunk_bytes)
        except (OSError, ValueError, OverflowError) as e:
            raise ValueError(f"cannot allocate a host pool of {num_chunks} chunks x {self.chunk_bytes} "
                             f"bytes: {e}") from None
        self.num_chunks = num_chunks
        self.last_error: str | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)
        self._in_flight: set[int] = set()
        self._waited: set[int] = set()  # job ids some wait() call blocks on
        self._finished: list[TransferResult] = []
        if self.use_cuda:
            self._init_cuda()
        else:
            self._init_thread()

    # ---- plans -------------------------------------------------------

    def _check(self, gpu: GPULoadStoreSpec, cpu: LoadStoreSpec) -> list[tuple[int, np.ndarray, np.ndarray, int]]:
        """Split a job by group into (group, GPU blocks, CPU slots, blocks to
        skip in the first chunk); raises ValueError on a bad spec. Cheap: it
        runs in the caller's thread, the plan is built by the copier."""
        if not isinstance(gpu, GPULoadStoreSpec):
            raise ValueError(f"GPU side must be a GPULoadStoreSpec, got {type(gpu).__name__}")
        if not isinstance(cpu, CPULoadStoreSpec):
            raise ValueError(f"CPU side must be a CPULoadStoreSpec, got {type(cpu).__name__}")
        if len(gpu.group_sizes) != len(self._pieces):
            raise ValueError(f"spec has {len(gpu.group_sizes)} groups, kv caches have {len(self._pieces)}")
        slots = cpu.block_ids
        if len(slots) and (slots.min() < 0 or slots.max() >= self.num_chunks):
            raise ValueError(f"CPU slot ids must be in [0, {self.num_chunks}), got {slots.tolist()}")
        groups, block_start, slot_start = [], 0, 0
        for g, (n, first) in enumerate(zip(gpu.group_sizes, gpu.block_indices)):
            k = self._block_factor[g]
            skip = first % k  # GPU blocks of the first chunk that are not in this job
            n_chunks = -(-(skip + n) // k)
            blocks = gpu.block_ids[block_start : block_start + n]
            group_slots = slots[slot_start : slot_start + n_chunks]
            block_start += n
            slot_start += n_chunks
            if n == 0 or not (len(self._pieces[g].size) or self._strided[g]) or len(group_slots) < n_chunks:
                continue  # nothing to copy (a short slot list is reported below)
            limit = self._min_blocks[g]
            if blocks.min() < 0 or blocks.max() >= limit:
                raise ValueError(f"group {g}: GPU block ids must be in [0, {limit}), got {blocks.tolist()}")
            groups.append((g, blocks, group_slots, skip))
        if slot_start != len(slots):
            raise ValueError(
                f"the GPU blocks (group_sizes {list(gpu.group_sizes)}, block_indices "
                f"{list(gpu.block_indices)}) span {slot_start} chunks, but {len(slots)} CPU slots were given"
            )
        return groups

    def _plan(self, job_id: int, direction: str, groups) -> _Job:
        """The byte ranges of a checked job, neighbours merged, and the
        stretches of its strided refs."""
        parts, strided, strided_bytes = [], [], 0
        for g, blocks, slots, skip in groups:
            p, k = self._pieces[g], self._block_factor[g]
            if self._strided[g]:
                pos = skip + np.arange(len(blocks), dtype=np.int64)
                by_turn: dict[tuple[int, int], list] = {}  # (writers, index) -> stretches; refs share them
                for st in self._strided[g]:
                    m = st.ref.mapping
                    turn = (m.num_writers, m.writer_index) if direction == STORE and self.shared_pool else (1, 0)
                    if turn not in by_turn:  # only the writer of a block writes it
                        mine = blocks % turn[0] == turn[1]
                        by_turn[turn] = _strided_stretches(blocks[mine], slots[pos[mine] // k], pos[mine] % k)
                    strided.append((st, by_turn[turn]))
                    strided_bytes += sum(x[2] for x in by_turn[turn]) * st.ref.page_size_bytes
            if not len(p.size):
                continue
            # shape (pieces, blocks): piece-major, so one layer's consecutive pages stay neighbours
            if k == 1:
                chunk_base = np.broadcast_to((slots * self.pool.chunk_bytes)[None, :], (len(p.size), len(blocks)))
            else:
                pos = skip + np.arange(len(blocks), dtype=np.int64)  # sub-block position in the job's chunks
                chunk_base = (slots[pos // k] * self.pool.chunk_bytes)[None, :] + (pos % k)[None, :] * p.page_in_chunk[:, None]
            columns = (
                np.broadcast_to(p.tensor_idx[:, None], chunk_base.shape),
                p.src_offset[:, None] + blocks[None, :] * p.block_stride[:, None],
                chunk_base + p.chunk_offset[:, None],
                np.broadcast_to(p.size[:, None], chunk_base.shape),
            )
            if direction == STORE and self.shared_pool:  # only the writer of a block writes it
                mine = blocks[None, :] % p.num_writers[:, None] == p.writer_index[:, None]
                columns = tuple(c[mine] for c in columns)  # same (piece-major) order as ravel
            parts.append(columns)
        if len(parts) == 1:
            arrays = [a.ravel() for a in parts[0]]
        elif parts:
            arrays = [np.concatenate([part[i].ravel() for part in parts]) for i in range(4)]
        else:
            arrays = [np.zeros(0, dtype=np.int64) for _ in range(4)]
        tidx, goff, poff, size = _merge_neighbours(*arrays)
        return _Job(job_id, direction, tidx, goff, poff, size, int(size.sum()) + strided_bytes, strided)

    # ---- OffloadingWorker -------------------------------------------

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        return self._submit(job_id, STORE, src_spec, dst_spec)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        return self._submit(job_id, LOAD, dst_spec, src_spec)

    def _submit(self, job_id: int, direction: str, gpu, cpu) -> bool:
        try:
            groups = self._check(gpu, cpu)
        except ValueError as e:
            return self._refuse(direction, f"job {job_id}: {e}")
        with self._lock:
            if self._closed:
                return self._refuse(direction, "worker is shut down")
            if job_id in self._in_flight:
                return self._refuse(direction, f"job {job_id} is already in flight")
            self._in_flight.add(job_id)
            if not self.use_cuda:  # under the lock: never behind shutdown's sentinel
                self._queue.put((job_id, direction, groups))
        if self.use_cuda:
            self._launch_cuda(job_id, direction, groups)
        return True

    def _refuse(self, direction: str, why: str) -> bool:
        self.last_error = why
        logger.warning("refused %s job: %s", direction, why)
        return False

    def get_finished(self) -> list[TransferResult]:
        if self.use_cuda:
            self._poll_cuda()
        with self._lock:
            out, self._finished = self._finished, []
        return out

    def wait(self, job_ids: set[int]) -> None:
        if self.use_cuda:
            self._poll_cuda(block_on=set(job_ids))
            return
        job_ids = set(job_ids)
        with self._done:
            self._waited |= job_ids & self._in_flight  # finished ones would never leave the set
            self._done.wait_for(lambda: not (self._in_flight & job_ids))

    def _finish(self, job_id: int, nbytes: int, seconds: float | None) -> None:
        """Report a job; nbytes < 0 means it failed."""
        with self._done:
            self._in_flight.discard(job_id)
            self._finished.append(TransferResult(job_id, nbytes >= 0, max(nbytes, 0), seconds))
            if job_id in self._waited:  # wake waiters only for what they wait on
                self._waited.discard(job_id)
                self._done.notify_all()

    def shutdown(self) -> None:
        """Finish the jobs already submitted, then stop and unpin the pool."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self.use_cuda:
            self._poll_cuda(block_on=set(self._in_flight))
        else:
            self._queue.put(None)
            self._thread.join()
        if not self.shared_pool:
            self.pool.close()  # a shared pool is closed by whoever made it

    # ---- CPU: one transfer thread -----------------------------------

    def _init_thread(self) -> None:
        self._gpu_base = np.array([kvt.tensor.data_ptr() for kvt in self.kv_caches.tensors] or [0],
                                  dtype=np.int64)
        self._pool_base = self.pool.tensor.data_ptr()
        for g, sts in enumerate(self._strided):
            for st in sts:
                st.views = self._run_views(st, self._block_factor[g])
        self._queue: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kvoffload-cpu-copy", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            job_id, direction, groups = item
            t0 = time.perf_counter()
            try:
                job = self._plan(job_id, direction, groups)
                self._copy(job)
            except Exception:  # a failed job never takes the thread down
                logger.exception("CPU offload %s job %d failed", direction, job_id)
                self._finish(job_id, -1, time.perf_counter() - t0)
            else:
                self._finish(job_id, job.nbytes, time.perf_counter() - t0)

    def _run_views(self, st: _Strided, k: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per CopyRun of a strided ref: its fragments in every GPU block,
        (blocks, fragments, words), and in every pool page, (slots, pages,
        fragments, words), as numpy views; words of the widest int that
        every offset and stride allows (wide elements copy faster)."""
        t = self.kv_caches.tensors[st.ref.tensor_idx].tensor
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

    def _copy(self, job: _Job) -> None:
        """The whole CPU copy path: memmove each byte range, np.copyto each
        stretch of a strided ref (both release the GIL)."""
        gpu = (self._gpu_base[job.tensor_idx] + job.gpu_offset).tolist()
        pool = (self._pool_base + job.pool_offset).tolist()
        memmove = ctypes.memmove
        if job.direction == STORE:
            for dst, src, n in zip(pool, gpu, job.size.tolist()):
                memmove(dst, src, n)
        else:
            for dst, src, n in zip(gpu, pool, job.size.tolist()):
                memmove(dst, src, n)
        copyto = np.copyto
        for st, stretches in job.strided:
            for gv, pv in st.views:
                if job.direction == STORE:
                    for g, p, _ in stretches:
                        copyto(pv[p], gv[g])
                else:
                    for g, p, _ in stretches:
                        copyto(gv[g], pv[p])

    # ---- CUDA: own streams and events -------------------------------

    def _byte_views(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        """1-D int8 views over each KV tensor's blocks and over the pool."""
        flat = []
        for kvt in self.kv_caches.tensors:
            t = kvt.tensor
            span = (t.shape[0] - 1) * t.stride(0) + t[0].numel()
            flat.append(t.view(torch.int8).as_strided((span,), (1,), t.storage_offset()))
        return flat, self.pool.tensor.view(torch.int8).view(-1)

    def _init_cuda(self) -> None:
        self._flat, self._pool_flat = self._byte_views()
        self._streams = {STORE: torch.cuda.Stream(self.device), LOAD: torch.cuda.Stream(self.device)}
        self._pending: dict[int, tuple[_Job, torch.cuda.Event, torch.cuda.Event]] = {}  # submit order

    def _launch_cuda(self, job_id: int, direction: str, groups) -> None:
        stream = self._streams[direction]
        try:
            job = self._plan(job_id, direction, groups)
            # never read (or overwrite) blocks before the compute stream is done with them
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
            stream.wait_event(ready)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                start.record(stream)
                self._copy_cuda(job)
                end.record(stream)
        except Exception:
            logger.exception("CUDA offload %s job %d failed to launch", direction, job_id)
            self._finish(job_id, -1, None)
            return
        with self._lock:
            self._pending[job.job_id] = (job, start, end)

    def _copy_cuda(self, job: _Job) -> None:
        """The whole CUDA copy path: one async copy per byte range."""
        pool, flat = self._pool_flat, self._flat
        ranges = zip(job.tensor_idx.tolist(), job.gpu_offset.tolist(), job.pool_offset.tolist(), job.size.tolist())
        if job.direction == STORE:
            for t, g, p, n in ranges:
                pool.narrow(0, p, n).copy_(flat[t].narrow(0, g, n), non_blocking=True)
        else:
            for t, g, p, n in ranges:
                flat[t].narrow(0, g, n).copy_(pool.narrow(0, p, n), non_blocking=True)

    def _poll_cuda(self, block_on: set[int] | None = None) -> None:
        with self._lock:
            pending = list(self._pending.values())
        for job, start, end in pending:
            if block_on and job.job_id in block_on:
                end.synchronize()
            elif not end.query():
                continue
            with self._lock:
                if self._pending.pop(job.job_id, None) is None:
                    continue  # another thread finished it
            self._finish(job.job_id, job.nbytes, start.elapsed_time(end) / 1000.0)
