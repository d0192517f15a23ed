"""Sliding windows (layout/windows.py): which blocks and chunks a KV group
needs to resume; a sliding-window group stores and loads only the chunks
inside its window."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from layout_ref import canonical_kv_caches, full_cache, rows

from kvoffload.abstractions import CPULoadStoreSpec, ReqContext, make_offload_key
from kvoffload.config import OffloadingConfig
from kvoffload.layout import LayerLayout, ParallelLayout, window_block_indices, window_chunks, window_gpu_spec
from kvoffload.tiers.cpu.spec import CPUOffloadingSpec
from kvoffload.tiers.cpu.worker import CPUOffloadingWorker

# ---- sliding windows --------------------------------------------------------

# group 0: full attention, 16-token blocks; group 1: 32-token blocks, a 48-token window.
# A chunk is 32 tokens: 2 blocks of group 0, 1 block of group 1.
CONFIG = OffloadingConfig.from_dict({
    "groups": [{"tokens_per_block": 16}, {"tokens_per_block": 32, "sliding_window": 48}],
    "tokens_per_hash": 16, "blocks_per_chunk": 2, "extra_config": {"num_cpu_chunks": 16}})
LAYERS = [LayerLayout(16, 2, 32, torch.float16), LayerLayout(32, 2, 32, torch.float16, kv="packed")]


def test_window_block_indices():
    assert window_block_indices(100, 16, None) == range(0, 6)
    # window 48: the next token (position 100) sees positions 53..100
    assert window_block_indices(100, 16, 48) == range(3, 6)
    assert window_block_indices(96, 16, 48) == range(3, 6)  # positions 49..95 -> blocks 3..5
    assert window_block_indices(96, 16, 49) == range(3, 6)  # 48..95
    assert window_block_indices(96, 16, 50) == range(2, 6)  # 47..95
    assert window_block_indices(10, 16, 4) == range(0, 0)  # no full block yet
    assert window_block_indices(0, 16, None) == range(0, 0)
    with pytest.raises(ValueError):
        window_block_indices(10, 16, 0)
    with pytest.raises(ValueError):
        window_block_indices(-1, 16, None)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 2000), bs=st.integers(1, 64), w=st.integers(1, 500))
def test_window_holds_exactly_the_tokens_attended(n, bs, w):
    got = window_block_indices(n, bs, w)
    full_blocks = n // bs
    needed = {p // bs for p in range(max(0, n - w + 1), n) if p // bs < full_blocks}
    assert set(got) == needed


def test_window_chunks():
    assert window_chunks(CONFIG, 0, 128) == range(0, 4)
    assert window_chunks(CONFIG, 1, 128) == range(2, 4)  # tokens 81..127 are in chunks 2 and 3
    assert window_chunks(CONFIG, 1, 130) == range(2, 4)  # only full chunks
    assert window_chunks(CONFIG, 1, 64, first_token=32) == range(1, 2)
    assert window_chunks(CONFIG, 1, 20) == range(0, 0)


@given(st.integers(0, 2000), st.integers(1, 300), st.sampled_from([16, 32, 64]))
def test_window_chunks_hold_the_window_and_start_inside_it(num_tokens, window, tpc):
    config = OffloadingConfig.from_dict({"groups": [{"tokens_per_block": 16, "sliding_window": window}],
                                         "tokens_per_hash": 16, "blocks_per_chunk": tpc // 16})
    r = window_chunks(config, 0, num_tokens)
    full = num_tokens // tpc
    assert r.stop == full
    first_needed = max(0, num_tokens - window + 1)  # the next token attends back to here
    if full:
        assert r.start * tpc <= first_needed or r.start == 0
        assert r.start == 0 or (r.start + 1) * tpc > first_needed  # no chunk wholly before it


def engine(seed):
    return [full_cache(layer, 16, seed=seed + i) for i, layer in enumerate(LAYERS)]


def kv_of(tensors):
    return canonical_kv_caches(list(zip(tensors, LAYERS)), [[0], [1]], ParallelLayout())


def keys_of(chunks):
    return [make_offload_key(bytes([g, c]) * 4, g) for g, r in enumerate(chunks) for c in r]


def test_sliding_window_group_stores_and_loads_only_its_window():
    spec = CPUOffloadingSpec(CONFIG)
    src = engine(0)
    worker = spec.get_worker(kv_of(src))
    manager = spec.get_manager()
    ctx = ReqContext("r")
    tables = [list(range(8)), [8, 9, 10, 11]]  # a 128-token request's GPU blocks
    gpu, chunks = window_gpu_spec(CONFIG, tables, 128)
    assert chunks == [range(0, 4), range(2, 4)]
    assert list(gpu.group_sizes) == [8, 2] and list(gpu.block_indices) == [0, 2]
    keys = keys_of(chunks)
    worker.pool.array[:] = 0xAB
    out = manager.prepare_store(keys, ctx)
    assert worker.submit_store(1, gpu, out.store_spec)
    worker.wait({1})
    [res] = worker.get_finished()
    page = [rows(t).shape[1] for t in src]
    assert res.success and res.transfer_size == 8 * page[0] + 2 * page[1]  # blocks 8 and 9 not written
    manager.complete_store(keys, ctx)
    slots = out.store_spec.block_ids
    assert not (worker.pool.array[slots] == 0xAB).all(axis=1).any()  # all 6 chunks hold data
    used = len(slots)
    assert (worker.pool.array[np.setdiff1d(np.arange(16), slots)] == 0xAB).all()  # nothing else touched

    # resume a 128-token request elsewhere: the window's keys are all it needs
    outside = keys_of([range(0), range(0, 2)])
    assert all(manager.lookup(k, ctx).name == "MISS" for k in outside)
    assert all(manager.lookup(k, ctx).name == "HIT" for k in keys)
    dst = [torch.full_like(t, 0) for t in src]
    for t in dst:
        rows(t)[:] = 0xCD
    worker2 = CPUOffloadingWorker(kv_of(dst), CONFIG, 16, pool=None)
    worker2.pool.array[:] = worker.pool.array  # the same host bytes, another engine
    tables2 = [list(range(15, 7, -1)), [0, 1, 2, 3]]
    gpu2, chunks2 = window_gpu_spec(CONFIG, tables2, 128)
    load = manager.prepare_load(keys_of(chunks2), ctx)
    assert isinstance(load, CPULoadStoreSpec) and len(load.block_ids) == used
    assert worker2.submit_load(2, load, gpu2)
    worker2.wait({2})
    assert worker2.get_finished()[0].success
    for i in range(8):
        assert torch.equal(rows(dst[0])[tables2[0][i]], rows(src[0])[tables[0][i]])
    for i in (2, 3):
        assert torch.equal(rows(dst[1])[tables2[1][i]], rows(src[1])[tables[1][i]])
    for i in (0, 1):  # outside the window: left alone
        assert (rows(dst[1])[tables2[1][i]] == 0xCD).all()
    manager.complete_load(keys_of(chunks2), ctx)
    worker.shutdown()
    worker2.shutdown()


def test_window_gpu_spec_checks_its_tables():
    with pytest.raises(ValueError, match="2 block tables for 1"):
        window_gpu_spec(OffloadingConfig.from_dict({"groups": [16]}), [[0], [1]], 16)
    with pytest.raises(ValueError, match="group 0: 128 tokens need 8 GPU blocks"):
        window_gpu_spec(CONFIG, [[0, 1], [0, 1, 2, 3]], 128)
