"""The CPU worker with its copies run inline (run_copies_inline): each job is
copied in the submitting thread before submit returns, and still reported
through get_finished; the bytes are those of the threaded copier."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvoffload.abstractions import CPULoadStoreSpec, GPULoadStoreSpec
from kvoffload.config import OffloadingConfig
from kvoffload.kv_caches import make_kv_caches
from kvoffload.tiers.cpu.worker import CPUOffloadingWorker

CONFIG = OffloadingConfig.from_dict({"groups": [16], "tokens_per_hash": 16})


def make_worker(page: int, blocks: int, slots: int, seed: int) -> tuple[CPUOffloadingWorker, torch.Tensor]:
    t = torch.randint(-128, 128, (blocks, page), dtype=torch.int8, generator=torch.Generator().manual_seed(seed))
    return CPUOffloadingWorker(make_kv_caches([t]), CONFIG, slots), t


@pytest.mark.parametrize("page", [1024, 64 * 1024])  # the gather path and the memmove path
@pytest.mark.parametrize("placement", ["random", "consecutive"])  # unmerged / merged ranges
def test_inline_jobs_copy_the_bytes_and_report_through_get_finished(page, placement):
    w, t = make_worker(page, 96, 64, seed=page)
    try:
        assert w.run_copies_inline()
        rng = np.random.default_rng(1)
        if placement == "random":
            blocks, slots = rng.permutation(48)[:32], rng.permutation(64)[:32]
        else:
            blocks, slots = np.arange(8, 40), np.arange(16, 48)
        src = t[torch.from_numpy(blocks)].clone()
        assert w.submit_store(1, GPULoadStoreSpec(blocks), CPULoadStoreSpec(slots)), w.last_error
        # done before submit returned: the pool holds the pages already
        for blk, slot in zip(blocks, slots):
            assert np.array_equal(w.pool.chunk(int(slot))[:page], t[int(blk)].numpy().view(np.uint8))
        (r,) = w.get_finished()
        assert (r.job_id, r.success, r.transfer_size) == (1, True, 32 * page)
        assert w.get_finished() == []
        dest = blocks + 48
        assert w.submit_load(2, CPULoadStoreSpec(slots), GPULoadStoreSpec(dest)), w.last_error
        w.wait({2})  # returns at once: nothing in flight
        (r,) = w.get_finished()
        assert (r.job_id, r.success, r.transfer_size) == (2, True, 32 * page)
        assert torch.equal(t[torch.from_numpy(dest)], src)
    finally:
        w.shutdown()


def test_switching_to_inline_finishes_the_queued_jobs_first():
    w, t = make_worker(4096, 40, 40, seed=3)
    try:
        for j in range(10):  # queued on the copy thread
            assert w.submit_store(j, GPULoadStoreSpec([2 * j, 2 * j + 1]), CPULoadStoreSpec([2 * j, 2 * j + 1]))
        assert w.run_copies_inline()
        done = {r.job_id for r in w.get_finished()}
        assert done == set(range(10))
        assert w.submit_load(10, CPULoadStoreSpec(list(range(20))), GPULoadStoreSpec(list(range(20, 40))))
        assert [r.job_id for r in w.get_finished()] == [10]
        assert torch.equal(t[20:40], t[0:20])
    finally:
        w.shutdown()


def test_an_inline_job_that_fails_is_reported_failed(monkeypatch):
    w, t = make_worker(1024, 40, 40, seed=4)
    try:
        w.run_copies_inline()

        def broken(plan):
            raise RuntimeError("copy failed")

        monkeypatch.setattr(w.copier, "copy", broken)  # the numpy plan's path
        monkeypatch.setattr(w.copier, "_copy_blocks", lambda direction, groups: broken(None))  # the extension's
        assert w.submit_store(1, GPULoadStoreSpec([0]), CPULoadStoreSpec([0]))
        (r,) = w.get_finished()
        assert (r.job_id, r.success) == (1, False)
    finally:
        w.shutdown()


def test_after_shutdown_an_inline_submit_is_refused():
    w, _ = make_worker(1024, 8, 8, seed=5)
    w.run_copies_inline()
    w.shutdown()
    assert not w.submit_store(1, GPULoadStoreSpec([0]), CPULoadStoreSpec([0]))
    assert "shut down" in w.last_error
