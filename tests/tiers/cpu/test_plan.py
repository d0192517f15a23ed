"""The copy planner (plan.py): which byte ranges a job moves, checked
against the bytes they name, independent of any executor."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.abstractions import CanonicalPageMapping, CopyRun, CPULoadStoreSpec, GPULoadStoreSpec
from kvoffload.config import OffloadingConfig
from kvoffload.kv_caches import random_kv_caches
from kvoffload.tiers.base import align_up
from kvoffload.tiers.cpu.plan import STORE, CopyPlanner, chunk_layout, merge_neighbours, strided_stretches

def config(groups, blocks_per_chunk=1):
    return OffloadingConfig.from_dict({"groups": groups, "tokens_per_hash": 16, "blocks_per_chunk": blocks_per_chunk})


def planner(kv, cfg, num_slots=16, strided=False, shared_pool=False):
    layout, chunk_bytes = chunk_layout(kv, cfg)
    return CopyPlanner(kv, cfg, layout, num_slots, align_up(chunk_bytes), shared_pool=shared_pool,
                       strided=strided)


def byte_pairs(tidx, gpu, pool, size):
    """Every (tensor, GPU byte, pool byte) the ranges copy, in order."""
    return [(t, g + i, p + i) for t, g, p, n in zip(tidx.tolist(), gpu.tolist(), pool.tolist(), size.tolist())
            for i in range(n)]


def test_contiguous_fragments_become_one_piece():
    # two runs that together are one contiguous 1024 B copy at canonical offset 512
    _, kv = random_kv_caches(8, [1024])
    runs = (CopyRun(0, 512, 128, 4, 128, 128), CopyRun(512, 1024, 256, 2, 256, 256))
    kv.group_data_refs[0][0].mapping = CanonicalPageMapping(2048, 1024, runs, 1, 0, False)
    p = planner(kv, config([16]), strided=True)
    assert p.pieces[0].size.tolist() == [1024] and p.pieces[0].chunk_offset.tolist() == [512]
    assert not p.strided[0]


def test_fragments_are_pieces_unless_strided():
    _, kv = random_kv_caches(8, [1024])
    run = CopyRun(0, 256, 256, 4, 256, 512)
    kv.group_data_refs[0][0].mapping = CanonicalPageMapping(2048, 1024, (run,), 1, 0, False)
    assert planner(kv, config([16])).pieces[0].chunk_offset.tolist() == [256, 768, 1280, 1792]
    p = planner(kv, config([16]), strided=True)
    assert not len(p.pieces[0].size) and len(p.strided[0]) == 1


def test_consecutive_blocks_into_consecutive_slots_merge_to_one_range():
    # one layer, one block per chunk: blocks 4..7 into slots 2..5 are one range
    _, kv = random_kv_caches(16, [4096])
    p = planner(kv, config([16]))
    plan = p.plan(1, STORE, p.check(GPULoadStoreSpec([4, 5, 6, 7]), CPULoadStoreSpec([2, 3, 4, 5])))
    assert plan.size.tolist() == [4 * 4096] and plan.nbytes == 4 * 4096
    assert (plan.gpu_offset.tolist(), plan.pool_offset.tolist()) == ([4 * 4096], [2 * 4096])
    shuffled = p.plan(2, STORE, p.check(GPULoadStoreSpec([4, 5, 6, 7]), CPULoadStoreSpec([2, 3, 5, 4])))
    assert shuffled.size.tolist() == [2 * 4096, 4096, 4096]


def test_plans_of_jobs_of_one_length_are_independent():
    # a plan that merged ranges does not change the next one of that length
    _, kv = random_kv_caches(16, [4096])
    p = planner(kv, config([16]))
    merged = p.plan(1, STORE, p.check(GPULoadStoreSpec([4, 5, 6]), CPULoadStoreSpec([2, 3, 4])))
    assert merged.size.tolist() == [3 * 4096]
    apart = p.plan(2, STORE, p.check(GPULoadStoreSpec([9, 1, 5]), CPULoadStoreSpec([7, 0, 3])))
    assert apart.tensor_idx.tolist() == [0, 0, 0] and apart.size.tolist() == [4096] * 3
    assert apart.gpu_offset.tolist() == [9 * 4096, 4096, 5 * 4096] and apart.nbytes == 3 * 4096
    _, kv2 = random_kv_caches(16, [4096, 2048])  # two pieces: piece-major rows
    p2 = planner(kv2, config([16]))
    two = p2.plan(3, STORE, p2.check(GPULoadStoreSpec([9, 1, 5]), CPULoadStoreSpec([7, 0, 3])))
    assert two.tensor_idx.tolist() == [0, 0, 0, 1, 1, 1] and two.size.tolist() == [4096] * 3 + [2048] * 3


def test_several_gpu_blocks_per_chunk_of_one_layer_merge():
    # 2 layers, 4 GPU blocks per chunk: a chunk holds 4 pages of layer 0, then 4 of layer 1
    _, kv = random_kv_caches(32, [512, 512])
    p = planner(kv, config([16], blocks_per_chunk=4))
    plan = p.plan(1, STORE, p.check(GPULoadStoreSpec([8, 9, 10, 11]), CPULoadStoreSpec([3])))
    assert plan.tensor_idx.tolist() == [0, 1] and plan.size.tolist() == [2048, 2048]
    assert plan.pool_offset.tolist() == [3 * p.slot_bytes, 3 * p.slot_bytes + 2048]


@settings(max_examples=60)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 40), st.integers(0, 40), st.integers(1, 4)),
                max_size=12))
def test_merging_copies_the_same_bytes_in_the_same_order(rows):
    cols = [np.array([r[i] for r in rows], dtype=np.int64) for i in range(4)]
    merged = merge_neighbours(*cols)
    assert byte_pairs(*merged) == byte_pairs(*cols)
    assert len(merged[3]) <= len(cols[3])
    # nothing left that continues its predecessor on both sides
    t, g, p, n = (a.tolist() for a in merged)
    assert not any(t[i] == t[i - 1] and g[i] == g[i - 1] + n[i - 1] and p[i] == p[i - 1] + n[i - 1]
                   for i in range(1, len(n)))


def test_store_into_a_shared_pool_plans_only_the_blocks_this_rank_writes():
    _, kv = random_kv_caches(8, [1024])
    run = CopyRun(0, 0, 1024, 1, 1024, 1024)  # replicated page: 2 writers, this rank writes odd blocks
    kv.group_data_refs[0][0].mapping = CanonicalPageMapping(1024, 1024, (run,), 2, 1, True)
    p = planner(kv, config([16]), shared_pool=True)
    groups = p.check(GPULoadStoreSpec([2, 3, 4, 5]), CPULoadStoreSpec([0, 1, 2, 3]))
    store = p.plan(1, STORE, groups)
    assert store.gpu_offset.tolist() == [3 * 1024, 5 * 1024] and store.nbytes == 2048
    assert p.plan(2, "load", groups).nbytes == 4 * 1024  # every rank loads every block


def test_check_refuses_slots_outside_the_pool_and_short_slot_lists():
    _, kv = random_kv_caches(8, [1024])
    p = planner(kv, config([16]), num_slots=4)
    with pytest.raises(ValueError, match="slot ids"):
        p.check(GPULoadStoreSpec([1]), CPULoadStoreSpec([4]))
    with pytest.raises(ValueError, match="span 2 chunks, but 1"):
        p.check(GPULoadStoreSpec([1, 2]), CPULoadStoreSpec([0]))
    with pytest.raises(ValueError, match="GPU block ids"):
        p.check(GPULoadStoreSpec([8]), CPULoadStoreSpec([0]))


@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6), st.integers(0, 2)), max_size=40))
def test_strided_stretches_cover_the_job_in_order(triples):
    def indices(i, n):
        return [i] * n if isinstance(i, int) else list(range(*i.indices(100)))[:n]

    cols = [np.array([t[i] for t in triples], dtype=np.int64) for i in range(3)]
    got = []
    for g, (s, u), n in strided_stretches(*cols):
        assert n == 1 or (isinstance(g, slice) and isinstance(s, slice) != isinstance(u, slice))
        got += zip(indices(g, n), indices(s, n), indices(u, n))
    assert got == [tuple(t) for t in triples]
