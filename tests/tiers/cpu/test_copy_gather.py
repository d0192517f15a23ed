"""The CPU copier's gather path (the fallback without the C extension): a job
of many small ranges is copied as one numpy gather/scatter instead of a
memmove per range; bytes must not change."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvoffload.abstractions import CPULoadStoreSpec, GPULoadStoreSpec
from kvoffload.config import OffloadingConfig
from kvoffload.kv_caches import make_kv_caches
from kvoffload.tiers.cpu import copy_cpu
from kvoffload.tiers.cpu.worker import CPUOffloadingWorker


@pytest.fixture
def gathers(monkeypatch):
    """Counts the jobs that took the gather path (the extension off: it copies every job)."""
    monkeypatch.setenv("KVOFFLOAD_NATIVE_COPY", "0")
    calls = []
    real = copy_cpu.CPUCopier._gather
    monkeypatch.setattr(copy_cpu.CPUCopier, "_gather", lambda self, plan: (calls.append(plan.job_id), real(self, plan)))
    return calls


def run(worker, job_id, direction, blocks, slots):
    gpu, cpu = GPULoadStoreSpec(blocks), CPULoadStoreSpec(slots)
    ok = worker.submit_store(job_id, gpu, cpu) if direction == "store" else worker.submit_load(job_id, cpu, gpu)
    assert ok, worker.last_error
    worker.wait({job_id})
    (r,) = worker.get_finished()
    assert r.success
    return r


@pytest.mark.parametrize("consecutive", [False, True], ids=["scattered", "consecutive-blocks"])
def test_many_small_ranges_round_trip_through_gather(gathers, consecutive):
    # two layers of different page sizes (so two range sizes in one job), the
    # first a view with a storage offset and a padded, odd block stride
    raw = torch.randint(-128, 128, (300, 1100), dtype=torch.int8, generator=torch.Generator().manual_seed(1))
    a = raw[4:, 13:1013]  # 296 blocks of 1000 B, stride 1100
    b = torch.randint(-128, 128, (296, 24), dtype=torch.int16, generator=torch.Generator().manual_seed(2))
    kv = make_kv_caches([a, b])
    w = CPUOffloadingWorker(kv, OffloadingConfig.from_dict({"groups": [16], "tokens_per_hash": 16}), 200)
    try:
        rng = np.random.default_rng(0)
        slots = rng.permutation(200)[:100]  # scattered in the pool
        # GPU side scattered, or consecutive (its ranges then a strided view of the tensor, no gather)
        blocks = np.arange(30, 130) if consecutive else rng.permutation(148)[:100]
        before_raw, before_b = raw.clone(), b.clone()
        r = run(w, 1, "store", blocks, slots)
        assert r.transfer_size == 100 * (1000 + 48)
        for blk, slot in zip(blocks, slots):  # the pool holds each block's pages back to back
            chunk = w.pool.chunk(int(slot))
            assert np.array_equal(chunk[:1000], a[blk].numpy().view(np.uint8))
            assert np.array_equal(chunk[1000:1048], b[blk].numpy().view(np.uint8))
        dest = blocks + 148  # load into other blocks
        r = run(w, 2, "load", dest, slots)
        assert r.transfer_size == 100 * (1000 + 48)
        assert gathers == [1, 2]
        idx_src, idx_dst = torch.from_numpy(blocks), torch.from_numpy(dest)
        assert torch.equal(a[idx_dst], a[idx_src]) and torch.equal(b[idx_dst], b[idx_src])
        untouched = torch.ones(296, dtype=torch.bool)
        untouched[idx_dst] = False
        assert torch.equal(b[untouched], before_b[untouched])
        before_raw[4:, 13:1013][idx_dst] = a[idx_dst]  # only the loaded pages changed, not the padding
        assert torch.equal(raw, before_raw)
    finally:
        w.shutdown()


@pytest.mark.parametrize(("page", "n", "gather"), [
    (copy_cpu.GATHER_BELOW - 8, copy_cpu.GATHER_MIN_RANGES, True),
    (copy_cpu.GATHER_BELOW, copy_cpu.GATHER_MIN_RANGES, False),
    (copy_cpu.GATHER_BELOW - 8, copy_cpu.GATHER_MIN_RANGES - 1, False),
])
def test_threshold_boundary_round_trips(gathers, page, n, gather):
    t = torch.randint(-128, 128, (4 * n, page), dtype=torch.int8, generator=torch.Generator().manual_seed(page))
    w = CPUOffloadingWorker(make_kv_caches([t]), OffloadingConfig.from_dict({"groups": [16], "tokens_per_hash": 16}),
                            2 * n)
    try:
        blocks = np.arange(0, 2 * n, 2)  # every other block, into slots in reverse: nothing merges
        slots = np.arange(2 * n - 1, -1, -2)
        run(w, 1, "store", blocks, slots)
        run(w, 2, "load", blocks + 2 * n, slots)
        assert gathers == ([1, 2] if gather else [])
        assert torch.equal(t[torch.from_numpy(blocks + 2 * n)], t[torch.from_numpy(blocks)])
        for blk, slot in zip(blocks, slots):
            assert np.array_equal(w.pool.chunk(int(slot))[:page], t[blk].numpy().view(np.uint8))
    finally:
        w.shutdown()
