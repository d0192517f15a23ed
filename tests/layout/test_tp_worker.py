"""The CPU worker copies through canonical mappings: TP ranks (threads, each
with its own CPUOffloadingWorker over its own CPU engine tensors) share one
HostPool; blocks stored at one TP size load at another."""

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
from layout_ref import canonical_kv_caches, full_cache, rows, shard

from kvoffload.abstractions import CPULoadStoreSpec, GPULoadStoreSpec
from kvoffload.config import OffloadingConfig
from kvoffload.layout import MLA, LayerLayout, ParallelLayout, opaque_mapping
from kvoffload.tiers.host_pool import HostPool
from kvoffload.tiers.cpu.worker import CPUOffloadingWorker, chunk_layout

NUM_GPU_BLOCKS = 16
NUM_CHUNKS = 12


class Ranks:
    """A TP deployment: per rank, its shard tensors and a worker on the shared pool."""

    def __init__(self, layers, groups, fulls, tp, config, pool=None):
        self.tp = tp
        self.engine, self.workers = [], []
        for r in range(tp):
            par = ParallelLayout(r, tp)
            tensors = [shard(f, layer, par) for f, layer in zip(fulls, layers)]
            kv = canonical_kv_caches(list(zip(tensors, layers)), groups, par)
            if pool is None:
                pool = HostPool(NUM_CHUNKS, chunk_layout(kv, config)[1])
            self.engine.append(tensors)
            self.workers.append(CPUOffloadingWorker(kv, config, NUM_CHUNKS, pool=pool))
        self.pool = pool

    def each_rank(self, fn):
        barrier = threading.Barrier(self.tp)

        def main(r):
            barrier.wait()
            return fn(r, self.workers[r])

        with ThreadPoolExecutor(self.tp) as ex:
            return [f.result() for f in [ex.submit(main, r) for r in range(self.tp)]]

    def transfer(self, direction, gpu_spec, cpu_spec, job_id=1):
        def go(r, w):
            submit = w.submit_store if direction == "store" else w.submit_load
            ok = submit(job_id, gpu_spec, cpu_spec) if direction == "store" else submit(job_id, cpu_spec, gpu_spec)
            assert ok, w.last_error
            w.wait({job_id})
            [res] = w.get_finished()
            assert res.success
            return res.transfer_size
        return self.each_rank(go)

    def shutdown(self):
        for w in self.workers:
            w.shutdown()


def expect_loaded(ranks, layers, groups, fulls, pairs_per_group):
    """pairs_per_group[g]: (stored GPU block, loaded GPU block) of each block."""
    for r in range(ranks.tp):
        par = ParallelLayout(r, ranks.tp)
        for g, layer_idxs in enumerate(groups):
            for li in layer_idxs:
                want, got = rows(shard(fulls[li], layers[li], par)), rows(ranks.engine[r][li])
                for src, dst in pairs_per_group[g]:
                    assert torch.equal(got[dst], want[src]), (r, li, src, dst)


CONFIG = OffloadingConfig.from_dict({"groups": [16], "tokens_per_hash": 16, "blocks_per_chunk": 2})


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_worker_stores_at_tp2_and_loads_at_tp1_and_tp4(kind):
    if kind == "gqa":
        layers = [LayerLayout(16, 4, 32, torch.bfloat16), LayerLayout(16, 4, 32, torch.bfloat16, order="HND")]
    else:
        layers = [LayerLayout(16, 1, 96, torch.bfloat16, kind=MLA) for _ in range(2)]
    fulls = [full_cache(layer, NUM_GPU_BLOCKS, seed=i) for i, layer in enumerate(layers)]
    storer = Ranks(layers, [[0, 1]], fulls, 2, CONFIG)
    stored = [2, 3, 9, 4, 5, 6]  # 3 chunks of 2 blocks
    sizes = storer.transfer("store", GPULoadStoreSpec(stored), CPULoadStoreSpec([7, 0, 3]))
    page = layers[0].block_size * layers[0].head_dim * 2 * (2 * 4 if kind == "gqa" else 1)
    # every canonical byte written once: GQA ranks write their heads, MLA ranks alternate blocks
    assert sum(sizes) == len(stored) * len(layers) * page and sizes[0] == sizes[1]
    for tp in (1, 4):
        loader = Ranks(layers, [[0, 1]], fulls, tp, CONFIG, pool=storer.pool)
        for tensors in loader.engine:
            for t in tensors:
                t.zero_()
        loaded = [15, 14, 13, 12, 11, 10]
        loader.transfer("load", GPULoadStoreSpec(loaded), CPULoadStoreSpec([7, 0, 3]))
        expect_loaded(loader, layers, [[0, 1]], fulls, [list(zip(stored, loaded))])
        loader.shutdown()
    storer.shutdown()
    storer.pool.close()


def test_worker_two_groups_different_block_sizes_sliding_window():
    config = OffloadingConfig.from_dict({
        "groups": [{"tokens_per_block": 16}, {"tokens_per_block": 32, "sliding_window": 48}],
        "tokens_per_hash": 16, "blocks_per_chunk": 2})
    layers = [LayerLayout(16, 2, 32, torch.float16), LayerLayout(32, 2, 32, torch.float16, kind="attention",
                                                                 kv="packed")]
    groups = [[0], [1]]
    fulls = [full_cache(layer, NUM_GPU_BLOCKS, seed=i) for i, layer in enumerate(layers)]
    storer = Ranks(layers, groups, fulls, 2, config)
    # a 128-token request: group 0 all 8 blocks (4 chunks); group 1 only its window, blocks 2-3
    g0, g1 = [1, 2, 3, 4, 5, 6, 7, 8], [10, 11]
    spec = GPULoadStoreSpec(g0 + g1, group_sizes=(8, 2), block_indices=(0, 2))
    storer.transfer("store", spec, CPULoadStoreSpec([0, 1, 2, 3, 4, 5]))
    loader = Ranks(layers, groups, fulls, 4, config, pool=storer.pool)
    l0, l1 = [15, 14, 13, 12, 11, 10, 9, 8], [3, 4]
    loader.transfer("load", GPULoadStoreSpec(l0 + l1, group_sizes=(8, 2), block_indices=(0, 2)),
                    CPULoadStoreSpec([0, 1, 2, 3, 4, 5]))
    expect_loaded(loader, layers, groups, fulls, [list(zip(g0, l0)), list(zip(g1, l1))])
    loader.shutdown()
    storer.shutdown()
    storer.pool.close()


def test_a_private_pool_keeps_every_block_of_this_rank():
    # MLA at TP=2 with a pool of its own: rank 1 must not skip rank 0's turns
    layer = LayerLayout(16, 1, 64, torch.bfloat16, kind=MLA)
    full = full_cache(layer, NUM_GPU_BLOCKS)
    par = ParallelLayout(1, 2)
    t = shard(full, layer, par)
    kv = canonical_kv_caches([(t, layer)], [[0]], par)
    w = CPUOffloadingWorker(kv, CONFIG, 4)
    assert w.submit_store(1, GPULoadStoreSpec([0, 1, 2, 3]), CPULoadStoreSpec([0, 1]))
    w.wait({1})
    t_before = t.clone()
    t.zero_()
    assert w.submit_load(2, CPULoadStoreSpec([0, 1]), GPULoadStoreSpec([0, 1, 2, 3]))
    w.wait({2})
    assert all(r.success for r in w.get_finished())
    assert torch.equal(rows(t)[:4], rows(t_before)[:4])  # bytes: random bf16 has NaNs
    w.shutdown()


def test_a_shared_pool_refuses_opaque_pages():
    layer = LayerLayout(16, 4, 32, torch.bfloat16)
    t = torch.zeros(4, 2, 16, 2, 32, dtype=torch.bfloat16)
    kv = canonical_kv_caches([(t, layer)], [[0]], ParallelLayout(0, 2))
    pool = HostPool(4, chunk_layout(kv, CONFIG)[1])
    kv.group_data_refs[0][0].mapping = opaque_mapping(t[0].numel() * 2)
    with pytest.raises(ValueError, match="cannot share a host pool"):
        CPUOffloadingWorker(kv, CONFIG, 4, pool=pool)
    kv2 = canonical_kv_caches([(t, layer)], [[0]], ParallelLayout(0, 2))
    with pytest.raises(ValueError, match="shared pool has 4 chunks"):
        CPUOffloadingWorker(kv2, CONFIG, 8, pool=pool)
    pool.close()


@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_replicated_heads_stored_at_tp4_load_at_tp1_and_tp2(order):
    # 2 KV heads over 4 ranks: ranks 0,1 hold head 0 and take turns writing it, by block
    layers = [LayerLayout(16, 2, 64, torch.float16, order=order), LayerLayout(16, 2, 64, torch.float16, kv="packed")]
    fulls = [full_cache(layer, NUM_GPU_BLOCKS, seed=5 + i) for i, layer in enumerate(layers)]
    storer = Ranks(layers, [[0, 1]], fulls, 4, CONFIG)
    stored = [0, 1, 7, 8, 3, 2]  # consecutive, a jump, backwards: stretches of every kind
    sizes = storer.transfer("store", GPULoadStoreSpec(stored), CPULoadStoreSpec([5, 2, 9]))
    page = 16 * 64 * 2 * 2  # one head, K and V
    assert sizes == [len(stored) // 2 * len(layers) * page] * 4  # writes spread evenly
    for tp in (1, 2):
        loader = Ranks(layers, [[0, 1]], fulls, tp, CONFIG, pool=storer.pool)
        loaded = [4, 5, 6, 9, 10, 11]
        loader.transfer("load", GPULoadStoreSpec(loaded), CPULoadStoreSpec([5, 2, 9]))
        expect_loaded(loader, layers, [[0, 1]], fulls, [list(zip(stored, loaded))])
        loader.shutdown()
    storer.shutdown()
    storer.pool.close()


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_strided_copies_round_trip_any_block_and_slot_order(data):
    # NHD at TP=2: one fragment per token, so the worker copies through strided views
    layer = LayerLayout(16, 4, 16, torch.float16)
    full = full_cache(layer, NUM_GPU_BLOCKS, seed=3)
    par = ParallelLayout(1, 2)
    t = shard(full, layer, par)
    kv = canonical_kv_caches([(t, layer)], [[0]], par)
    w = CPUOffloadingWorker(kv, CONFIG, NUM_CHUNKS)
    assert w.planner.strided[0]  # not the per-fragment path
    n_chunks = data.draw(st.integers(1, 6))
    skip = data.draw(st.integers(0, 1))
    n = 2 * n_chunks - skip
    blocks = data.draw(st.permutations(range(NUM_GPU_BLOCKS)))[:n]
    slots = data.draw(st.permutations(range(NUM_CHUNKS)))[:n_chunks]
    if data.draw(st.booleans()):
        blocks = sorted(blocks, reverse=data.draw(st.booleans()))
    before = rows(t).clone()
    gpu = GPULoadStoreSpec(blocks, block_indices=[skip])
    assert w.submit_store(1, gpu, CPULoadStoreSpec(slots))
    w.wait({1})
    t.zero_()
    assert w.submit_load(2, CPULoadStoreSpec(slots), gpu)
    w.wait({2})
    assert all(r.success for r in w.get_finished())
    for b in range(NUM_GPU_BLOCKS):
        assert torch.equal(rows(t)[b], before[b] if b in blocks else torch.zeros_like(before[b])), b
    w.shutdown()
