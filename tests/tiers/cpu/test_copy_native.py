"""The C copy extension (kvoffload.tiers.cpu._memcopy): its checks, and a
worker using it moves exactly the bytes of one on the fallback (the ctypes
loop and numpy gather), for random jobs of stores and loads, merged and
unmerged ranges, several tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvoffload.abstractions import CPULoadStoreSpec, GPULoadStoreSpec
from kvoffload.config import OffloadingConfig
from kvoffload.kv_caches import make_kv_caches
from kvoffload.tiers.cpu import copy_cpu
from kvoffload.tiers.cpu.worker import CPUOffloadingWorker

pytestmark = pytest.mark.skipif(
    copy_cpu._memcopy is None,
    reason="the C copy extension is not built (pip install -e . or python setup.py build_ext --inplace); "
           "the copier uses its ctypes fallback")

CONFIG = OffloadingConfig.from_dict({"groups": [16], "tokens_per_hash": 16})
I64 = np.int64


def addr(a: np.ndarray) -> int:
    return a.ctypes.data


def test_copy_moves_each_range_and_returns_the_bytes():
    src = np.arange(256, dtype=np.uint8)
    dst = np.zeros(256, dtype=np.uint8)
    n = copy_cpu._memcopy.copy(addr(dst), np.array([0, 100, 7], I64), addr(src), np.array([50, 3, 200], I64),
                               np.array([10, 20, 0], I64))
    assert n == 30
    expect = np.zeros(256, dtype=np.uint8)
    expect[0:10], expect[100:120] = src[50:60], src[3:23]
    assert np.array_equal(dst, expect)
    # a negative offset from a base (the copier's bases are each tensor's block 0)
    copy_cpu._memcopy.copy(addr(dst) + 200, np.array([-200], I64), addr(src), np.array([0], I64), np.array([4], I64))
    assert dst[:4].tolist() == [0, 1, 2, 3]
    assert copy_cpu._memcopy.copy(0, np.zeros(0, I64), 0, np.zeros(0, I64), np.zeros(0, I64)) == 0


@pytest.mark.parametrize("size", [(128 << 10) - 16, 128 << 10, (256 << 10) + 16, (1 << 20) + 40])
@pytest.mark.parametrize("shift", [0, 16, 3])
def test_large_ranges_aligned_or_not_copy_exactly(size, shift):
    # from 128 KiB with 16-byte aligned ends the extension streams (non-temporal stores);
    # a tail below 64 bytes, a misaligned end (shift 3) or a smaller range take memmove
    rng = np.random.default_rng(size + shift)
    src = rng.integers(0, 256, 3 * size + 64, dtype=np.uint8)
    dst = np.zeros(3 * size + 64, dtype=np.uint8)
    offs = np.array([shift, 2 * size + shift], I64)
    n = copy_cpu._memcopy.copy(addr(dst), offs[::-1].copy(), addr(src), offs, np.array([size, size], I64))
    assert n == 2 * size
    assert np.array_equal(dst[2 * size + shift:3 * size + shift], src[shift:size + shift])
    assert np.array_equal(dst[shift:size + shift], src[2 * size + shift:3 * size + shift])
    assert not dst[:shift].any() and not dst[size + shift:2 * size + shift].any()


OK = np.zeros(2, I64)


@pytest.mark.parametrize(("args", "match"), [
    ((0, [0, 0], 0, OK, OK), "dst_offsets must be an int64 array, got list"),
    ((0, OK, 0, OK.astype(np.int32), OK), "src_offsets must be a 1-D int64 array, got format 'i'"),
    ((0, OK, 0, OK, OK.astype(np.float64)), "sizes must be a 1-D int64 array, got format 'd'"),
    ((0, np.zeros((2, 1), I64), 0, OK, OK), "dst_offsets must be a 1-D int64 array.*2 dimension"),
    ((0, np.zeros(4, I64)[::2], 0, OK, OK), "dst_offsets must be contiguous"),
    ((0, OK, 0, np.zeros(3, I64), OK), "differ in length: 2, 3, 2"),
    ((0, OK, 0, OK, np.array([0, -1], I64)), r"sizes\[1\] is negative"),
    ((0, b"\0" * 16, 0, OK, OK), "dst_offsets must be a 1-D int64 array, got format 'B'"),
])
def test_bad_arguments_are_a_clear_value_error(args, match):
    with pytest.raises(ValueError, match=match):
        copy_cpu._memcopy.copy(*args)


def test_wrong_argument_count_or_base_is_a_type_error():
    with pytest.raises(TypeError, match="takes 5 arguments, got 2"):
        copy_cpu._memcopy.copy(0, OK)
    with pytest.raises(TypeError):
        copy_cpu._memcopy.copy("0", OK, 0, OK, OK)


def test_the_env_var_forces_the_fallback(monkeypatch):
    monkeypatch.delenv("KVOFFLOAD_NATIVE_COPY", raising=False)
    assert copy_cpu.native_copy() is copy_cpu._memcopy.copy
    monkeypatch.setenv("KVOFFLOAD_NATIVE_COPY", "0")
    assert copy_cpu.native_copy() is None


def two_workers(pages: list[int], blocks: int, slots: int, seed: int, monkeypatch):
    """A worker with the extension and one on the fallback, each on its own
    copy of the same random tensors (one per page size)."""
    gen = torch.Generator().manual_seed(seed)
    base = [torch.randint(-128, 128, (blocks, p), dtype=torch.int8, generator=gen) for p in pages]
    out = []
    for native in (True, False):
        monkeypatch.setenv("KVOFFLOAD_NATIVE_COPY", "1" if native else "0")
        ts = [t.clone() for t in base]
        w = CPUOffloadingWorker(make_kv_caches(ts), CONFIG, slots)
        assert (w.copier._native is not None) == native
        out.append((w, ts))
    return out


def run_on_both(workers, jobs) -> None:
    """Run the same (direction, GPU spec, CPU spec) jobs on the native and the
    fallback worker: same reported sizes, same bytes in pool and tensors."""
    reported = []
    for w, _ in workers:
        for job_id, (direction, gpu, cpu) in enumerate(jobs):
            ok = w.submit_store(job_id, gpu, cpu) if direction == "store" else w.submit_load(job_id, cpu, gpu)
            assert ok, w.last_error
        w.wait(set(range(len(jobs))))
        results = w.get_finished()
        assert all(r.success for r in results)
        reported.append(sorted((r.job_id, r.transfer_size) for r in results))
    assert reported[0] == reported[1]
    (native, native_ts), (fallback, fallback_ts) = workers
    assert np.array_equal(native.pool.array, fallback.pool.array)
    for a, b in zip(native_ts, fallback_ts):
        assert torch.equal(a, b)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("pages", [[1024], [1024, 512, 2048], [64 * 1024, 4096], [256 * 1024]],
                         ids=["1k", "3-tensors", "64k+4k", "256k-streamed"])
def test_native_and_fallback_copy_the_same_bytes(pages, seed, monkeypatch):
    nblocks, nslots = 200, 120
    workers = two_workers(pages, nblocks, nslots, seed, monkeypatch)
    try:
        rng = np.random.default_rng(seed)
        jobs = []  # the same random jobs for both: stores, then loads into other blocks
        for j in range(12):
            n = int(rng.integers(1, 40))
            if rng.random() < 0.5:  # consecutive blocks into consecutive slots: ranges merge
                b0, s0 = int(rng.integers(0, nblocks - n)), int(rng.integers(0, nslots - n))
                blocks, slots = np.arange(b0, b0 + n), np.arange(s0, s0 + n)
            else:  # scattered: nothing merges
                blocks, slots = rng.permutation(nblocks)[:n], rng.permutation(nslots)[:n]
            jobs.append(("store" if j < 6 else "load", blocks, slots))
        run_on_both(workers, [(d, GPULoadStoreSpec(b), CPULoadStoreSpec(s)) for d, b, s in jobs])
    finally:
        for w, _ in workers:
            w.shutdown()


def test_copy_blocks_checks_the_slot_count_and_the_pieces():
    rows, blocks = np.zeros((1, 5), I64), np.arange(5, dtype=I64)
    with pytest.raises(ValueError, match="5 blocks from page 1 of a 2-page chunk span 3 slots, got 2"):
        copy_cpu._memcopy.copy_blocks(True, rows, 0, 0, 2, 1, blocks, np.zeros(2, I64))
    with pytest.raises(ValueError, match="pieces must have 5 columns, got 4"):
        copy_cpu._memcopy.copy_blocks(True, np.zeros((1, 4), I64), 0, 0, 1, 0, blocks, np.zeros(5, I64))
    with pytest.raises(ValueError, match="k must be >= 1"):
        copy_cpu._memcopy.copy_blocks(True, rows, 0, 0, 0, 0, blocks, np.zeros(5, I64))
    with pytest.raises(TypeError, match="takes 8 arguments"):
        copy_cpu._memcopy.copy_blocks(True, rows)


@pytest.mark.parametrize("seed", range(4))
def test_two_groups_of_chunks_of_two_blocks_started_mid_chunk_copy_the_same_bytes(seed, monkeypatch):
    # group 0: one layer; group 1: two layers of other page sizes; 2 GPU blocks per chunk,
    # a job's first block anywhere in its chunk; block ids a strided view (a spec may hold one)
    config = OffloadingConfig.from_dict({"groups": [16, 16], "tokens_per_hash": 16, "blocks_per_chunk": 2})
    gen = torch.Generator().manual_seed(seed)
    base = [torch.randint(-128, 128, (64, p), dtype=torch.int8, generator=gen) for p in (512, 256, 1024)]
    workers = []
    for native in ("1", "0"):
        monkeypatch.setenv("KVOFFLOAD_NATIVE_COPY", native)
        ts = [t.clone() for t in base]
        workers.append((CPUOffloadingWorker(make_kv_caches(ts, groups=[[0], [1, 2]]), config, 60), ts))
    assert workers[0][0].copier._rows is not None and workers[1][0].copier._native is None
    try:
        rng = np.random.default_rng(seed)
        jobs = []
        for j in range(10):
            sizes = [int(rng.integers(1, 12)), int(rng.integers(0, 12))]
            firsts = [int(rng.integers(0, 4)), int(rng.integers(0, 4))]
            chunks = sum(-(-(f % 2 + n) // 2) for f, n in zip(firsts, sizes))
            ids = np.empty(2 * sum(sizes), dtype=np.int64)
            ids[::2] = rng.permutation(64)[: sum(sizes)]
            gpu = GPULoadStoreSpec(ids[::2], group_sizes=sizes, block_indices=firsts)
            jobs.append(("store" if j < 5 else "load", gpu, CPULoadStoreSpec(rng.permutation(60)[:chunks])))
        run_on_both(workers, jobs)
    finally:
        for w, _ in workers:
            w.shutdown()


def test_outside_matches_the_numpy_check():
    from kvoffload.tiers.cpu.plan import _outside

    rng = np.random.default_rng(0)
    for _ in range(200):
        ids = rng.integers(-3, 40, int(rng.integers(0, 12)))
        limit = int(rng.integers(0, 40))
        for view in (ids, ids[::2], ids[::-1]):
            assert copy_cpu._memcopy.outside(view, limit) == _outside(np.ascontiguousarray(view), limit)
    with pytest.raises(ValueError, match="ids must be a 1-D int64 array"):
        copy_cpu._memcopy.outside(np.zeros(2, np.int32), 5)
    with pytest.raises(TypeError, match="takes 2 arguments"):
        copy_cpu._memcopy.outside(OK)


def test_the_planner_checks_ids_with_the_extension_unless_turned_off(monkeypatch):
    t = torch.zeros((8, 64), dtype=torch.int8)
    monkeypatch.delenv("KVOFFLOAD_NATIVE_COPY", raising=False)
    w = CPUOffloadingWorker(make_kv_caches([t]), CONFIG, 4)
    monkeypatch.setenv("KVOFFLOAD_NATIVE_COPY", "0")
    w_fb = CPUOffloadingWorker(make_kv_caches([t]), CONFIG, 4)
    try:
        assert w.planner._outside is copy_cpu._memcopy.outside and w_fb.planner._outside is not w.planner._outside
        for worker in (w, w_fb):
            assert not worker.submit_store(1, GPULoadStoreSpec([8]), CPULoadStoreSpec([0]))
            assert "GPU block ids must be in [0, 8)" in worker.last_error
            assert not worker.submit_store(1, GPULoadStoreSpec([0]), CPULoadStoreSpec([-1]))
            assert "CPU slot ids must be in [0, 4)" in worker.last_error
    finally:
        w.shutdown()
        w_fb.shutdown()
