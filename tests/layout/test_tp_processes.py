"""TP ranks as processes: each rank's worker stores into one SharedHostPool
(a MAP_SHARED file), and another layout loads the canonical pages back."""

import multiprocessing

import pytest
import torch
from layout_ref import canonical_kv_caches, full_cache, rows, shard

from kvoffload.abstractions import CPULoadStoreSpec, GPULoadStoreSpec
from kvoffload.config import OffloadingConfig
from kvoffload.layout import LayerLayout, ParallelLayout
from kvoffload.tiers.host_pool import SharedHostPool
from kvoffload.tiers.cpu.worker import CPUOffloadingWorker, chunk_layout

CONFIG = OffloadingConfig.from_dict({"groups": [16], "tokens_per_hash": 16, "blocks_per_chunk": 2})
LAYERS = [LayerLayout(16, 2, 64, torch.float16), LayerLayout(16, 2, 64, torch.float16, order="HND")]
NUM_BLOCKS, NUM_CHUNKS = 12, 6
STORED, SLOTS = [3, 4, 11, 10, 0, 1], [4, 0, 5]


def rank_kv(par):
    fulls = [full_cache(layer, NUM_BLOCKS, seed=i) for i, layer in enumerate(LAYERS)]
    tensors = [shard(f, layer, par) for f, layer in zip(fulls, LAYERS)]
    return fulls, tensors, canonical_kv_caches(list(zip(tensors, LAYERS)), [[0, 1]], par)


def store_as_rank(args):
    """One TP rank, in a process of its own: store STORED into the shared pool."""
    path, rank, tp, chunk_bytes = args
    torch.set_num_threads(1)
    _, _, kv = rank_kv(ParallelLayout(rank, tp))
    pool = SharedHostPool.open(path, NUM_CHUNKS, chunk_bytes)
    w = CPUOffloadingWorker(kv, CONFIG, NUM_CHUNKS, pool=pool)
    assert w.submit_store(1, GPULoadStoreSpec(STORED), CPULoadStoreSpec(SLOTS)), w.last_error
    w.wait({1})
    [res] = w.get_finished()
    w.shutdown()
    pool.close()
    return res.success, res.transfer_size


@pytest.mark.slow
def test_ranks_in_processes_store_at_tp4_and_tp1_loads(tmp_path):
    # 2 heads over 4 ranks: each head is replicated, its two ranks take turns by block
    fulls, tensors, kv = rank_kv(ParallelLayout(0, 1))
    chunk_bytes = chunk_layout(kv, CONFIG)[1]
    pool = SharedHostPool.create(tmp_path / "pool", NUM_CHUNKS, chunk_bytes)
    with multiprocessing.get_context("spawn").Pool(4) as procs:
        results = procs.map(store_as_rank, [(tmp_path / "pool", r, 4, chunk_bytes) for r in range(4)])
    page = 16 * 64 * 2 * 2  # one head's K and V
    assert results == [(True, len(STORED) // 2 * len(LAYERS) * page)] * 4  # writes spread evenly
    for t in tensors:
        t.zero_()
    w = CPUOffloadingWorker(kv, CONFIG, NUM_CHUNKS, pool=pool)
    loaded = [5, 6, 7, 8, 9, 2]
    assert w.submit_load(2, CPULoadStoreSpec(SLOTS), GPULoadStoreSpec(loaded))
    w.wait({2})
    assert w.get_finished()[0].success
    for full, t in zip(fulls, tensors):
        for src, dst in zip(STORED, loaded):
            assert torch.equal(rows(t)[dst], rows(full)[src])
    w.shutdown()
    pool.close()
    assert not (tmp_path / "pool").exists()


def test_ranks_must_agree_on_the_pool(tmp_path):
    pool = SharedHostPool.create(tmp_path / "pool", 4, 8192)
    with pytest.raises(FileExistsError):
        SharedHostPool.create(tmp_path / "pool", 4, 8192)
    with pytest.raises(ValueError, match="the ranks disagree on the pool"):
        SharedHostPool.open(tmp_path / "pool", 8, 8192)
    other = SharedHostPool.open(tmp_path / "pool", 4, 8192)
    other.array[3, 100] = 7  # one memory
    assert pool.chunk(3)[100] == 7
    other.close()
    assert (tmp_path / "pool").exists()  # only its creator removes it
    pool.close()
    assert not (tmp_path / "pool").exists()


def test_missing_or_foreign_pool_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="TP rank 0"):
        SharedHostPool.open(tmp_path / "none", 4, 8192, wait_s=0.05)
    foreign = tmp_path / "foreign"
    foreign.write_bytes(b"not a pool" * 1000)
    with pytest.raises(ValueError, match="is not a kvoffload shared host pool"):
        SharedHostPool.open(foreign)
    with pytest.raises(ValueError, match="is not a kvoffload shared host pool"):
        SharedHostPool.open(foreign, 4, 8192)
