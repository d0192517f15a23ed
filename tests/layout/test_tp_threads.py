"""Blocks stored under one tensor-parallel layout load under another.

Each rank is a thread with its own CPU engine tensors (its shard of the KV
heads); all ranks of a deployment share one HostPool, whose chunk slots hold
canonical pages (for each group, for each layer, the chunk's pages back to
back). A rank writes only the blocks it is the writer of, and loads its part
of every block.
"""

import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from layout_ref import canonical_kv_caches, full_cache, load_pages, rows, shard, store_pages

from kvoffload.config import OffloadingConfig
from kvoffload.layout import (
    MLA,
    LayerLayout,
    ParallelLayout,
    parallel_layout_id,
    window_block_indices,
)
from kvoffload.tiers.host_pool import HostPool

NUM_GPU_BLOCKS = 24


def chunk_offsets(kv, config):
    """Per group: (ref, byte offset in the chunk) of each layer's pages."""
    out = []
    for g, refs in enumerate(kv.group_data_refs):
        off, layout = 0, []
        for ref in refs:
            layout.append((ref, off))
            off += config.gpu_blocks_per_chunk(g) * ref.mapping.canonical_page_size_bytes
        out.append(layout)
    return out


def pages_of(pool, slot, ref, off, n):
    """The n canonical pages of one layer in one chunk slot, as (n, bytes) rows."""
    size = ref.mapping.canonical_page_size_bytes
    return pool.tensor[slot, off:off + n * size].view(n, size)


class Deployment:
    """One TP layout of a model: per rank, its engine tensors and kv caches."""

    def __init__(self, layers, groups, fulls, tp, config):
        self.tp, self.config, self.groups = tp, config, groups
        self.engine = []  # per rank: its shard of every layer's tensor
        self.kv = []
        for r in range(tp):
            par = ParallelLayout(r, tp)
            tensors = [shard(full, layer, par) for full, layer in zip(fulls, layers)]
            self.engine.append(tensors)
            self.kv.append(canonical_kv_caches(list(zip(tensors, layers)), groups, par))
        self.written = Counter()  # rank -> canonical bytes it wrote

    def zero(self):
        for tensors in self.engine:
            for t in tensors:
                t.zero_()

    def run_ranks(self, fn):
        """Run fn(rank) on every rank at once, one thread each."""
        barrier = threading.Barrier(self.tp)

        def rank_main(r):
            barrier.wait()
            fn(r)

        with ThreadPoolExecutor(self.tp) as ex:
            for f in [ex.submit(rank_main, r) for r in range(self.tp)]:
                f.result()

    def store(self, pool, keys):
        """keys: (group, chunk slot, GPU block ids of that chunk) to store."""
        def rank(r):
            kv = self.kv[r]
            layout = chunk_offsets(kv, self.config)
            for g, slot, block_ids in keys:
                for ref, off in layout[g]:
                    src = kv.tensors[ref.tensor_idx].tensor
                    dst = pages_of(pool, slot, ref, off, len(block_ids))
                    for j, b in enumerate(block_ids):
                        if ref.mapping.is_writer(b):
                            store_pages(ref.mapping, src[b:b + 1], dst[j:j + 1])
                            self.written[r] += ref.mapping.local_page_size_bytes
        self.run_ranks(rank)

    def load(self, pool, keys):
        def rank(r):
            kv = self.kv[r]
            layout = chunk_offsets(kv, self.config)
            for g, slot, block_ids in keys:
                for ref, off in layout[g]:
                    dst = kv.tensors[ref.tensor_idx].tensor
                    src = pages_of(pool, slot, ref, off, len(block_ids))
                    for j, b in enumerate(block_ids):
                        load_pages(ref.mapping, src[j:j + 1], dst[b:b + 1])
        self.run_ranks(rank)


def make_keys(config, block_ids_per_group, chunks_per_group):
    """(group, slot, GPU block ids) per stored chunk; slot = group * 100 + chunk."""
    keys = []
    for g, chunks in enumerate(chunks_per_group):
        n = config.gpu_blocks_per_chunk(g)
        for c in chunks:
            keys.append((g, g * 100 + c, block_ids_per_group[g][c * n:(c + 1) * n]))
    return keys


def check_loaded(dep, layers, fulls, store_ids, load_ids, logical_blocks_per_group, groups):
    """Each rank's engine holds, at its load block ids, what its shard of
    the TP=1 tensor holds at the stored block ids."""
    for r in range(dep.tp):
        par = ParallelLayout(r, dep.tp)
        for g, layer_idxs in enumerate(groups):
            for li in layer_idxs:
                want = rows(shard(fulls[li], layers[li], par))
                got = rows(dep.engine[r][li])
                for i, gpu_id in enumerate(load_ids[g]):
                    if i in logical_blocks_per_group[g]:
                        assert torch.equal(got[gpu_id], want[store_ids[g][i]]), (r, g, li, i)
                    else:  # outside a sliding window: never loaded
                        assert not got[gpu_id].any(), (r, g, li, i)


def round_trip(layers, groups, config, store_tp, load_tps, chunks_per_group, num_chunks):
    fulls = [full_cache(layer, NUM_GPU_BLOCKS, seed=i) for i, layer in enumerate(layers)]
    n_blocks = [num_chunks * config.gpu_blocks_per_chunk(g) for g in range(len(groups))]
    store_ids = [list(range(3, 3 + n)) for n in n_blocks]  # GPU ids of logical blocks
    storer = Deployment(layers, groups, fulls, store_tp, config)
    kv0 = storer.kv[0]
    chunk_bytes = max(sum(config.gpu_blocks_per_chunk(g) * r.mapping.canonical_page_size_bytes
                          for r in refs) for g, refs in enumerate(kv0.group_data_refs))
    pool = HostPool(len(groups) * 100, chunk_bytes)
    storer.store(pool, make_keys(config, store_ids, chunks_per_group))

    # the pool holds TP=1 pages: compare with a TP=1 deployment's bytes
    single = Deployment(layers, groups, fulls, 1, config).kv[0]
    for g, c_list in enumerate(chunks_per_group):
        n = config.gpu_blocks_per_chunk(g)
        for c in c_list:
            for (ref, off), li in zip(chunk_offsets(single, config)[g], groups[g]):
                stored = pages_of(pool, g * 100 + c, ref, off, n)
                assert torch.equal(stored, rows(fulls[li])[store_ids[g][c * n:(c + 1) * n]])

    # every canonical byte was written exactly once, spread over the writers
    canonical_total = sum(len(ids) * ref.mapping.canonical_page_size_bytes
                          for g, _, ids in make_keys(config, store_ids, chunks_per_group)
                          for ref in kv0.group_data_refs[g])
    assert sum(storer.written.values()) == canonical_total

    for tp in load_tps:
        loader = Deployment(layers, groups, fulls, tp, config)
        loader.zero()
        load_ids = [list(range(NUM_GPU_BLOCKS - 1, NUM_GPU_BLOCKS - 1 - n, -1)) for n in n_blocks]
        loader.load(pool, make_keys(config, load_ids, chunks_per_group))
        logical = [[i for c in cs for i in range(c * config.gpu_blocks_per_chunk(g),
                                                 (c + 1) * config.gpu_blocks_per_chunk(g))]
                   for g, cs in enumerate(chunks_per_group)]
        check_loaded(loader, layers, fulls, store_ids, load_ids, logical, groups)
    pool.close()
    return storer


CONFIG = OffloadingConfig.from_dict({"groups": [16], "tokens_per_hash": 16, "blocks_per_chunk": 2})


@pytest.mark.parametrize("heads", [8, 2])  # 8: split 4/2 per rank; 2: replicated at TP=4
def test_gqa_stored_at_tp2_loads_at_tp1_and_tp4(heads):
    layers = [LayerLayout(16, heads, 64, torch.bfloat16, kv="split", order="NHD"),
              LayerLayout(16, heads, 64, torch.bfloat16, kv="split", order="HND")]
    storer = round_trip(layers, [[0, 1]], CONFIG, store_tp=2, load_tps=[1, 4],
                        chunks_per_group=[[0, 1, 2]], num_chunks=3)
    assert storer.written[0] == storer.written[1]  # each rank writes its half
    assert parallel_layout_id(storer.kv[0], ParallelLayout(0, 2), shared_pool=True) == "agnostic"


def test_mla_stored_at_tp2_is_written_once_and_loads_at_tp1_and_tp4():
    layers = [LayerLayout(16, 1, 576, torch.bfloat16, kind=MLA) for _ in range(2)]
    storer = round_trip(layers, [[0, 1]], CONFIG, store_tp=2, load_tps=[1, 4],
                        chunks_per_group=[[0, 1, 2, 3]], num_chunks=4)
    page = 16 * 576 * 2
    # 8 blocks x 2 layers, rotated by block: each rank writes half, not all
    assert storer.written == Counter({0: 8 * page, 1: 8 * page})


def test_replicated_heads_stored_at_tp4_rotate_writers_and_load_at_tp2():
    layers = [LayerLayout(16, 2, 64, torch.float16)]  # 2 heads over 4 ranks: 2 copies each
    storer = round_trip(layers, [[0]], CONFIG, store_tp=4, load_tps=[1, 2],
                        chunks_per_group=[[0, 1, 2, 3]], num_chunks=4)
    assert len(set(storer.written.values())) == 1 and len(storer.written) == 4


def test_two_groups_with_different_block_sizes_and_a_sliding_window_round_trip():
    config = OffloadingConfig.from_dict({
        "groups": [{"tokens_per_block": 16}, {"tokens_per_block": 32, "sliding_window": 48}],
        "tokens_per_hash": 16, "blocks_per_chunk": 2})  # 32-token chunks: 2 and 1 GPU blocks
    layers = [LayerLayout(16, 4, 32, torch.bfloat16),  # group 0: full attention
              LayerLayout(16, 4, 32, torch.bfloat16, order="HND"),
              LayerLayout(32, 2, 32, torch.float16)]  # group 1: sliding window, bigger blocks
    groups = [[0, 1], [2]]
    num_tokens, num_chunks = 128, 4
    window = window_block_indices(num_tokens, 32, 48)
    assert list(window) == [2, 3]  # the window needs only the last two blocks
    round_trip(layers, groups, config, store_tp=2, load_tps=[1, 4],
               chunks_per_group=[list(range(num_chunks)), list(window)], num_chunks=num_chunks)
