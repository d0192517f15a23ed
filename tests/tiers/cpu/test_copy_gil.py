"""The fallback's memmove path (no C extension) gives up the GIL around one
range per GIL_EVERY bytes (WAITER_GIL_EVERY in a waiting caller) and keeps
it for the others: the bytes are the same either way, for ranges below,
across and above that budget, stored and loaded."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvoffload.abstractions import CPULoadStoreSpec, GPULoadStoreSpec
from kvoffload.config import OffloadingConfig
from kvoffload.kv_caches import make_kv_caches
from kvoffload.tiers.cpu import copy_cpu
from kvoffload.tiers.cpu.worker import CPUOffloadingWorker

CONFIG = OffloadingConfig.from_dict({"groups": [16], "tokens_per_hash": 16})


@pytest.mark.parametrize("gil_every", [0, 48 * 1024, copy_cpu.GIL_EVERY])
def test_ranges_around_the_gil_budget_copy_the_same_bytes(gil_every, monkeypatch):
    if gil_every and copy_cpu._MEMMOVE_KEEPING_GIL is None:
        pytest.skip("no GIL-keeping memmove on this platform")
    monkeypatch.setenv("KVOFFLOAD_NATIVE_COPY", "0")  # the budgets are the ctypes loop's
    monkeypatch.setattr(copy_cpu, "GIL_EVERY", gil_every)
    monkeypatch.setattr(copy_cpu, "WAITER_GIL_EVERY", gil_every)  # wait() below may copy the job itself
    page = 16 * 1024  # consecutive blocks merge into ranges of 16 KiB ... 1.5 MiB
    t = torch.randint(-128, 128, (256, page), dtype=torch.int8, generator=torch.Generator().manual_seed(7))
    w = CPUOffloadingWorker(make_kv_caches([t]), CONFIG, 160)
    try:
        rng = np.random.default_rng(3)
        # 96 consecutive blocks into consecutive slots (one 1.5 MiB range), 9 random
        # ones (16 KiB each), then 8 consecutive again (one 128 KiB range)
        blocks = np.concatenate([np.arange(0, 96), rng.permutation(np.arange(96, 128))[:9], np.arange(128, 136)])
        slots = np.concatenate([np.arange(10, 106), rng.permutation(np.arange(130, 160))[:9], np.arange(110, 118)])
        assert w.submit_store(1, GPULoadStoreSpec(blocks), CPULoadStoreSpec(slots)), w.last_error
        w.wait({1})
        assert w.pool.array[slots, :page].tobytes() == t[torch.from_numpy(blocks)].numpy().tobytes()
        back = np.arange(136, 136 + len(blocks))  # loaded back as one run of fresh blocks
        assert w.submit_load(2, CPULoadStoreSpec(slots), GPULoadStoreSpec(back)), w.last_error
        w.wait({2})
        assert torch.equal(t[torch.from_numpy(back)], t[torch.from_numpy(blocks)])
        assert [r.success for r in w.get_finished()] == [True, True]
    finally:
        w.shutdown()
