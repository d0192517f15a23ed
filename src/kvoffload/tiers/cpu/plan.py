"""The CPU tier's copy planner: which bytes a store or load job moves.

Numpy, no copying, shared by both executors (copy_cpu.py, copy_cuda.py);
the per-job id check calls the C extension (_memcopy.c) when it is built.

Chunk layout inside a pool slot of a key of group g: for each ref of
group_data_refs[g] in order, gpu_blocks_per_chunk(g) pages of that ref,
back to back. A ref with a CanonicalPageMapping stores canonical pages
(canonical_page_size_bytes each). A pool of this rank's own gets all of
its fragments. The TP ranks of a node may instead share one HostPool
(every ref canonical): a chunk then holds whole canonical pages, a rank
stores only the blocks it is the writer of (`is_writer`), and every rank
loads its part (see kvoffload/layout/).

A *piece* is one contiguous byte range of a GPU page and where it goes in
a chunk: a whole unmapped page, or one CopyRun fragment of a mapped page
(fragments that continue each other on both sides are merged first). A
mapped ref of several fragments may instead be *strided* (CPU executor
only): it is copied as numpy strided views, one slice per *stretch* of
blocks whose GPU block ids and pool positions advance by constant steps.

A job's *plan* is flat arrays of (tensor index, byte offset in that
tensor, byte offset in the pool, bytes), built with a few numpy ops from
per-piece offsets precomputed at start, with ranges that continue the
previous one on both sides merged; plus its strided refs' stretches.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from kvoffload.abstractions import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    LoadStoreSpec,
)
from kvoffload.config import OffloadingConfig

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


class Piece(NamedTuple):
    """One contiguous byte range of a GPU page and its place in a chunk."""

    tensor_idx: int  # which kv tensor
    src_offset: int  # byte offset of the piece inside a GPU page
    block_stride: int  # bytes between GPU blocks of that tensor
    chunk_offset: int  # byte offset of the piece's first page in a chunk
    page_in_chunk: int  # bytes between sub-block pages in a chunk
    size: int  # bytes
    num_writers: int  # ranks holding the piece's bytes (1 if unmapped)
    writer_index: int  # this rank's turn among them


@dataclass
class Pieces:
    """One group's pieces as parallel int64 arrays, one per Piece field."""

    tensor_idx: np.ndarray
    src_offset: np.ndarray
    block_stride: np.ndarray
    chunk_offset: np.ndarray
    page_in_chunk: np.ndarray
    size: np.ndarray
    num_writers: np.ndarray
    writer_index: np.ndarray
    min_blocks: int  # GPU block ids must be below this
    total: int = 0  # bytes of all pieces of one block

    def __post_init__(self):
        # (pieces, 1) views that broadcast against a job's blocks, made once
        self.stride_col, self.src_col = self.block_stride[:, None], self.src_offset[:, None]
        self.chunk_col, self.page_col = self.chunk_offset[:, None], self.page_in_chunk[:, None]
        self.writers_col, self.turn_col = self.num_writers[:, None], self.writer_index[:, None]

    @classmethod
    def of(cls, rows: list[Piece], min_blocks: int) -> Pieces:
        cols = np.array(rows, dtype=np.int64).reshape(-1, len(Piece._fields)).T
        return cls(*cols, min_blocks=min_blocks, total=sum(r.size for r in rows))


@dataclass(eq=False)  # hashed by identity: executors key their views on it
class StridedRef:
    """A mapped ref copied through strided views (CPU executor only)."""

    ref: CanonicalKVCacheRef
    chunk_offset: int  # of its first page in a chunk
    page_in_chunk: int  # bytes between its pages in a chunk


class GroupJob(NamedTuple):
    """One KV group's share of a checked job."""

    group: int
    blocks: np.ndarray  # GPU block ids
    slots: np.ndarray  # pool slots, one per chunk
    skip: int  # GPU blocks of the first chunk that are not in the job


@dataclass
class Plan:
    """What one job copies: merged byte ranges and strided stretches."""

    job_id: int
    direction: str  # STORE (GPU -> pool) or LOAD (pool -> GPU)
    tensor_idx: np.ndarray
    gpu_offset: np.ndarray  # into the tensor's storage from its first block
    pool_offset: np.ndarray  # into the pool from its first slot
    size: np.ndarray
    nbytes: int
    strided: list[tuple[StridedRef, list[tuple]]]  # each strided ref with its stretches

    def ranges(self, gpu_base: np.ndarray, pool_base: int) -> Iterator[tuple[int, int, int]]:
        """(dst address, src address, bytes) of each range in this plan's
        direction, given each tensor's and the pool's base address."""
        gpu = (gpu_base[self.tensor_idx] + self.gpu_offset).tolist()
        pool = (pool_base + self.pool_offset).tolist()
        sizes = self.size.tolist()
        return zip(pool, gpu, sizes) if self.direction == STORE else zip(gpu, pool, sizes)


def base_addresses(kv_caches: CanonicalKVCaches, pool) -> tuple[np.ndarray, int]:
    """Address of block 0 of each KV tensor, and of the pool's first slot:
    a plan's offsets count from these."""
    gpu = np.array([kvt.tensor.data_ptr() for kvt in kv_caches.tensors] or [0], dtype=np.int64)
    return gpu, pool.tensor.data_ptr()


def _fragments(ref: CanonicalKVCacheRef, page: int) -> list[tuple[int, int, int]]:
    """(local offset, canonical offset, size) of a mapped ref's fragments,
    each merged with the previous one when it continues it on both sides."""
    out: list[tuple[int, int, int]] = []
    for run in ref.mapping.runs:
        for i in range(run.num_fragments):
            lo = run.local_offset + i * run.local_stride
            co = run.canonical_offset + i * run.canonical_stride
            if lo + run.fragment_size > ref.page_size_bytes or co + run.fragment_size > page:
                raise ValueError(f"tensor {ref.tensor_idx}: CopyRun {run} leaves the page")
            if out and out[-1][0] + out[-1][2] == lo and out[-1][1] + out[-1][2] == co:
                out[-1] = (out[-1][0], out[-1][1], out[-1][2] + run.fragment_size)
            else:
                out.append((lo, co, run.fragment_size))
    return out


def group_pieces(kv_caches: CanonicalKVCaches, layout, group: int,
                 strided: list[StridedRef] | None = None) -> Pieces:
    """The group's pieces. With `strided`, mapped refs of several fragments
    go there instead of becoming one piece per fragment."""
    rows: list[Piece] = []
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
            rows.append(Piece(ref.tensor_idx, 0, stride, offset, page, ref.page_size_bytes, 1, 0))
            continue
        fragments = _fragments(ref, page)
        if strided is not None and len(fragments) > 1:
            strided.append(StridedRef(ref, offset, page))
            continue
        m = ref.mapping
        rows += [Piece(ref.tensor_idx, lo, stride, offset + co, page, n, m.num_writers, m.writer_index)
                 for lo, co, n in fragments]
    return Pieces.of(rows, min_blocks or 0)


def _span(start: int, step: int, n: int) -> slice:
    """n indices from start by step (a stop below 0 would count from the end)."""
    stop = start + step * n
    return slice(start, stop if stop >= 0 else None, step)


def strided_stretches(b: np.ndarray, s: np.ndarray, u: np.ndarray) -> list[tuple]:
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


def merge_neighbours(tidx, gpu, pool, size):
    """Merge ranges that continue the previous one on both sides."""
    if len(size) <= 1:
        return tidx, gpu, pool, size
    cont = gpu[1:] == gpu[:-1] + size[:-1]
    if not cont.any():  # random placement: nothing merges; stop after one test
        return tidx, gpu, pool, size
    cont &= (pool[1:] == pool[:-1] + size[:-1]) & (tidx[1:] == tidx[:-1])
    if not cont.any():
        return tidx, gpu, pool, size
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    return tidx[starts], gpu[starts], pool[starts], np.add.reduceat(size, starts)


_EMPTY = np.zeros(0, dtype=np.int64)


def _outside(ids: np.ndarray, limit: int) -> bool:
    """Whether any int64 id is outside [0, limit): one comparison, as a
    negative id read as unsigned is huge (this runs per job in the caller)."""
    return bool((ids.view(np.uint64) >= limit).any())


try:  # the C extension (tiers/cpu/_memcopy.c), built at install by setup.py; optional
    from kvoffload.tiers.cpu import _memcopy
except ImportError:
    _memcopy = None


def native_module():
    """The C extension, or None: not built, or KVOFFLOAD_NATIVE_COPY=0 (the
    fallback: tests, benchmarks). Its calls replace numpy ones run per job:
    Python right after a large copy finds the caches cold, ~10 us per numpy
    call here."""
    return None if _memcopy is None or os.environ.get("KVOFFLOAD_NATIVE_COPY", "1") == "0" else _memcopy


class CopyPlanner:
    """Checks jobs and plans their copies for one worker's KV caches and pool.

    strided: copy mapped refs of several fragments as strided views (the
    CPU executor); else every fragment is a piece. shared_pool: the TP
    ranks share the pool, so a store writes only the blocks this rank is
    the writer of (in a private pool a rank writes all it will load back).
    """

    def __init__(self, kv_caches: CanonicalKVCaches, config: OffloadingConfig, layout,
                 num_slots: int, slot_bytes: int, shared_pool: bool, strided: bool):
        self.num_slots, self.slot_bytes, self.shared_pool = num_slots, slot_bytes, shared_pool
        native = native_module()
        self._outside = native.outside if native is not None else _outside
        self.strided: list[list[StridedRef]] = [[] for _ in layout]
        self.pieces = [group_pieces(kv_caches, layout, g, self.strided[g] if strided else None)
                       for g in range(len(layout))]
        self.blocks_per_chunk = [config.gpu_blocks_per_chunk(g) for g in range(len(layout))]
        self.block_limit = []  # per group: GPU block ids must be below this
        for p, sts in zip(self.pieces, self.strided):
            limits = [p.min_blocks] if len(p.size) else []
            limits += [kv_caches.tensors[st.ref.tensor_idx].tensor.shape[0] for st in sts]
            self.block_limit.append(min(limits, default=0))

    def check(self, gpu: GPULoadStoreSpec, cpu: LoadStoreSpec) -> list[GroupJob]:
        """Split a job by group; raises ValueError on a bad spec. Cheap: it
        runs in the caller's thread, the plan is built by the executor."""
        if not isinstance(gpu, GPULoadStoreSpec):
            raise ValueError(f"GPU side must be a GPULoadStoreSpec, got {type(gpu).__name__}")
        if not isinstance(cpu, CPULoadStoreSpec):
            raise ValueError(f"CPU side must be a CPULoadStoreSpec, got {type(cpu).__name__}")
        if len(gpu.group_sizes) != len(self.pieces):
            raise ValueError(f"spec has {len(gpu.group_sizes)} groups, kv caches have {len(self.pieces)}")
        slots, outside = cpu.slots, self._outside
        whole = len(gpu.group_sizes) == 1  # one group: the spec's arrays are its own (no slicing)
        if outside(slots, self.num_slots):
            raise ValueError(f"CPU slot ids must be in [0, {self.num_slots}), got {slots.tolist()}")
        groups, block_start, slot_start = [], 0, 0
        for g, (n, first) in enumerate(zip(gpu.group_sizes, gpu.block_indices)):
            k = self.blocks_per_chunk[g]
            skip = first % k
            n_chunks = -(-(skip + n) // k)
            blocks = gpu.block_ids if whole else gpu.block_ids[block_start : block_start + n]
            group_slots = slots if whole and n_chunks == len(slots) else slots[slot_start : slot_start + n_chunks]
            block_start += n
            slot_start += n_chunks
            if n == 0 or not (len(self.pieces[g].size) or self.strided[g]) or len(group_slots) < n_chunks:
                continue  # nothing to copy (a short slot list is reported below)
            limit = self.block_limit[g]
            if outside(blocks, limit):
                raise ValueError(f"group {g}: GPU block ids must be in [0, {limit}), got {blocks.tolist()}")
            groups.append(GroupJob(g, blocks, group_slots, skip))
        if slot_start != len(slots):
            raise ValueError(
                f"the GPU blocks (group_sizes {list(gpu.group_sizes)}, block_indices "
                f"{list(gpu.block_indices)}) span {slot_start} chunks, but {len(slots)} CPU slots were given"
            )
        return groups

    def plan(self, job_id: int, direction: str, groups: list[GroupJob]) -> Plan:
        """The byte ranges of a checked job, neighbours merged, and the
        stretches of its strided refs."""
        parts, strided, nbytes = [], [], 0
        writers_only = direction == STORE and self.shared_pool
        for g, blocks, slots, skip in groups:
            p, k = self.pieces[g], self.blocks_per_chunk[g]
            if self.strided[g]:
                pos = skip + np.arange(len(blocks), dtype=np.int64)
                by_turn: dict[tuple[int, int], list] = {}  # (writers, index) -> stretches; refs share them
                for st in self.strided[g]:
                    m = st.ref.mapping
                    turn = (m.num_writers, m.writer_index) if writers_only else (1, 0)
                    if turn not in by_turn:  # only the writer of a block writes it
                        mine = blocks % turn[0] == turn[1]
                        by_turn[turn] = strided_stretches(blocks[mine], slots[pos[mine] // k], pos[mine] % k)
                    strided.append((st, by_turn[turn]))
                    nbytes += sum(x[2] for x in by_turn[turn]) * st.ref.page_size_bytes
            if not len(p.size):
                continue
            # shape (pieces, blocks): piece-major, so one layer's consecutive pages stay neighbours.
            # Few numpy ops on small arrays: this runs once per job on the copy thread.
            n = len(blocks)
            gpu = blocks * p.stride_col + p.src_col
            if k == 1:
                pool = slots * self.slot_bytes + p.chunk_col
            else:
                pos = skip + np.arange(n, dtype=np.int64)  # sub-block position in the job's chunks
                pool = slots[pos // k] * self.slot_bytes + p.chunk_col + (pos % k) * p.page_col
            tidx, size = np.repeat(p.tensor_idx, n), np.repeat(p.size, n)
            if writers_only:  # only the writer of a block writes it
                mine = (blocks % p.writers_col == p.turn_col).ravel()
                parts.append((tidx[mine], gpu.ravel()[mine], pool.ravel()[mine], size[mine]))
                nbytes += int(parts[-1][3].sum())
            else:
                parts.append((tidx, gpu.ravel(), pool.ravel(), size))
                nbytes += n * p.total
        if len(parts) == 1:
            arrays = parts[0]
        elif parts:
            arrays = [np.concatenate([part[i] for part in parts]) for i in range(4)]
        else:
            arrays = [_EMPTY] * 4
        tidx, goff, poff, size = merge_neighbours(*arrays)
        return Plan(job_id, direction, tidx, goff, poff, size, nbytes, strided)
