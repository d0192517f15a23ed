"""Canonical page mappings (layout/canonical.py): derivation, tiling check, fallback, namespace ids."""

import dataclasses
from collections import Counter

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st
from layout_ref import block_rows, canonical_kv_caches, full_cache, load_pages, rows, shard, store_pages

from kvoffload.abstractions import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    CanonicalPageMapping,
    CopyRun,
)
from kvoffload.layout import (
    MLA,
    LayerLayout,
    LayoutError,
    ParallelLayout,
    canonical_layout_id,
    check_shareable,
    layer_mapping,
    opaque_mapping,
    parallel_layout_id,
    try_layer_mapping,
    verify_tiling,
)

FORMATS = [("split", "NHD"), ("split", "HND"), ("packed", "NHD"), ("packed", "HND")]


def all_ranks(layer, tp):
    return [try_layer_mapping(layer, ParallelLayout(r, tp)) for r in range(tp)]


def store_all_ranks_then_load_each(layer, tp, num_blocks=5):
    """Every rank stores the blocks it writes; then every rank loads all
    blocks back. Returns (canonical pages, TP=1 pages, per-rank results)."""
    full = full_cache(layer, num_blocks, seed=tp)
    maps = all_ranks(layer, tp)
    canon = torch.zeros(num_blocks, maps[0].canonical_page_size_bytes, dtype=torch.uint8)
    for r, m in enumerate(maps):
        local = rows(shard(full, layer, ParallelLayout(r, tp)))
        for b in range(num_blocks):
            if m.is_writer(b):
                store_pages(m, local[b:b + 1], canon[b:b + 1])
    loaded = []
    for r, m in enumerate(maps):
        want = rows(shard(full, layer, ParallelLayout(r, tp)))
        got = torch.zeros_like(want)
        load_pages(m, canon, got)
        loaded.append((got, want))
    return canon, rows(full), loaded


@pytest.mark.parametrize("kv,order", FORMATS)
def test_tp1_is_identity(kv, order):
    layer = LayerLayout(16, 4, 64, torch.float16, kv=kv, order=order)
    m = layer_mapping(layer, ParallelLayout(0, 1))
    assert m.canonical_page_size_bytes == m.local_page_size_bytes == 2 * 16 * 4 * 64 * 2
    assert m.parallelism_agnostic and m.num_writers == 1
    canon, full, [(got, want)] = store_all_ranks_then_load_each(layer, 1)
    assert torch.equal(canon, full) and torch.equal(got, want)


@settings(max_examples=60, deadline=None)
@given(heads=st.sampled_from([1, 2, 3, 4, 6, 8]), tp=st.sampled_from([1, 2, 3, 4, 8]),
       head_dim=st.sampled_from([1, 3, 8, 64]), block_size=st.sampled_from([1, 2, 16]),
       fmt=st.sampled_from(FORMATS), dtype=st.sampled_from([torch.int8, torch.bfloat16, torch.float32]))
def test_any_mappable_layout_round_trips(heads, tp, head_dim, block_size, fmt, dtype):
    layer = LayerLayout(block_size, heads, head_dim, dtype, kv=fmt[0], order=fmt[1])
    if (heads >= tp and heads % tp) or (heads < tp and tp % heads):
        with pytest.raises(LayoutError):
            try_layer_mapping(layer, ParallelLayout(0, tp))
        return
    verify_tiling(all_ranks(layer, tp))
    canon, full, loaded = store_all_ranks_then_load_each(layer, tp, num_blocks=3)
    assert torch.equal(canon, full)  # the canonical page is the TP=1 page
    for got, want in loaded:
        assert torch.equal(got, want)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_mla_every_rank_writes_a_share(tp):
    layer = LayerLayout(16, 1, 576, torch.bfloat16, kind=MLA)
    maps = all_ranks(layer, tp)
    assert [m.writer_index for m in maps] == list(range(tp))
    assert all(m.num_writers == tp and m.canonical_page_size_bytes == 16 * 576 * 2 for m in maps)
    writes = Counter(r for b in range(400) for r, m in enumerate(maps) if m.is_writer(b))
    assert set(writes.values()) == {400 // tp}
    canon, full, loaded = store_all_ranks_then_load_each(layer, tp, num_blocks=2 * tp)
    assert torch.equal(canon, full)
    assert all(torch.equal(g, w) for g, w in loaded)


def test_gqa_replicated_heads_rotate_writers_evenly():
    layer = LayerLayout(16, 2, 128, torch.bfloat16)  # 2 KV heads, 8 ranks: 4 replicas per head
    maps = all_ranks(layer, 8)
    assert [(m.num_writers, m.writer_index) for m in maps] == [(4, i % 4) for i in range(8)]
    writes = Counter(r for b in range(1000) for r, m in enumerate(maps) if m.is_writer(b))
    assert sorted(writes.values()) == [250] * 8
    for b in range(8):  # each block: exactly one writer per head
        assert sum(m.is_writer(b) for m in maps) == 2


def test_tiling_rejects_gap_and_overlap():
    layer = LayerLayout(16, 8, 64, torch.float16)
    maps = all_ranks(layer, 4)
    verify_tiling(maps)
    with pytest.raises(LayoutError, match="gap at byte"):
        verify_tiling(maps[:3])  # a missing rank leaves its heads uncovered
    with pytest.raises(LayoutError, match="overlap"):
        verify_tiling([maps[0], maps[0], maps[2], maps[3]])  # rank 0's heads twice
    shifted = dataclasses.replace(maps[1].runs[0], canonical_offset=maps[1].runs[0].canonical_offset + 2)
    with pytest.raises(LayoutError, match="overlap|gap"):
        verify_tiling([maps[0], dataclasses.replace(maps[1], runs=(shifted,)), maps[2], maps[3]])
    mla = all_ranks(LayerLayout(16, 1, 64, torch.float16, kind=MLA), 2)
    with pytest.raises(LayoutError, match="overlap"):  # both ranks writing every block
        verify_tiling([dataclasses.replace(m, num_writers=1, writer_index=0) for m in mla])
    with pytest.raises(LayoutError, match="writer_index"):
        verify_tiling([dataclasses.replace(mla[0], writer_index=2)])


def test_tiling_rejects_runs_out_of_page_and_local_gaps():
    n = 64
    ok = opaque_mapping(n)
    verify_tiling([ok])
    past_end = dataclasses.replace(ok, runs=(CopyRun(8, 8, n, 1, n, n),))
    with pytest.raises(LayoutError, match="leaves the"):
        verify_tiling([past_end])
    half = dataclasses.replace(ok, runs=(CopyRun(0, 0, 32, 1, 32, 32), CopyRun(0, 32, 32, 1, 32, 32)))
    with pytest.raises(LayoutError, match="local page: overlap"):
        verify_tiling([half])


def test_unmappable_layout_falls_back_to_opaque():
    layer = LayerLayout(16, 6, 64, torch.float16)  # 6 heads do not split over 4 ranks
    with pytest.raises(LayoutError, match="do not split evenly"):
        layer_mapping(layer, ParallelLayout(1, 4))
    m = layer_mapping(layer, ParallelLayout(1, 4), local_page_size_bytes=1234)
    assert m == opaque_mapping(1234) and not m.parallelism_agnostic
    # engine allocated other than the TP rule says
    odd = dataclasses.replace(layer, num_kv_heads=8, kv_heads_per_rank=3)
    assert not layer_mapping(odd, ParallelLayout(0, 4), 4096).parallelism_agnostic
    # engine page size disagrees with the layout
    good = dataclasses.replace(layer, num_kv_heads=8)
    assert not layer_mapping(good, ParallelLayout(0, 4), 999).parallelism_agnostic


def test_namespace_ids_say_which_layouts_may_read_a_pool():
    gqa = LayerLayout(16, 8, 64, torch.bfloat16, name="layers.0")
    mla = LayerLayout(16, 1, 96, torch.bfloat16, kind=MLA, name="layers.1")
    par = ParallelLayout(1, 2)
    t0 = torch.zeros(6, 2, 16, 4, 64, dtype=torch.bfloat16)
    t1 = torch.zeros(6, 16, 96, dtype=torch.bfloat16)
    kv = canonical_kv_caches([(t0, gqa), (t1, mla), (t0, gqa)], [[0, 2], [1]], par)
    assert kv.group_data_refs[1][0].mapping.num_writers == 2
    assert parallel_layout_id(kv, par, shared_pool=True) == "agnostic"
    check_shareable(kv)
    # a private pool holds only this rank's heads of a GQA page
    assert parallel_layout_id(kv, par) == "tp2-rank1"
    mla_only = CanonicalKVCaches(kv.tensors, [kv.group_data_refs[1]])
    assert parallel_layout_id(mla_only, par) == "agnostic"  # every rank holds the whole latent
    kv.group_data_refs[1][0].mapping = opaque_mapping(t1[0].numel() * 2)
    assert parallel_layout_id(kv, par, shared_pool=True) == "tp2-rank1"
    with pytest.raises(ValueError, match="group 1 ref 0 .*cannot share a host pool"):
        check_shareable(kv)
    uncertified = CanonicalKVCaches([CanonicalKVCacheTensor(block_rows(t1), 3072)],
                                    [[CanonicalKVCacheRef(0, 3072)]])
    assert parallel_layout_id(uncertified, ParallelLayout()) == "tp1-rank0"
    hnd = dataclasses.replace(gqa, order="HND")
    assert canonical_layout_id([gqa, mla]) != canonical_layout_id([hnd, mla])
    assert canonical_layout_id([gqa, mla]) == canonical_layout_id([gqa, mla])


def test_unknown_kind_or_format_is_a_layout_error():
    for bad in (dict(kind="conv"), dict(kv="interleaved"), dict(order="THD"), dict(head_dim=0)):
        with pytest.raises(LayoutError):
            layer = dataclasses.replace(LayerLayout(16, 8, 64, torch.float16), **bad)
            try_layer_mapping(layer, ParallelLayout())


def brute_force_tiles(mappings):
    """verify_tiling's rule, byte by byte."""
    import math
    size = mappings[0].canonical_page_size_bytes
    if any(m.canonical_page_size_bytes != size or not 0 <= m.writer_index < m.num_writers for m in mappings):
        return False
    for m in mappings:
        local = [0] * m.local_page_size_bytes
        for r in m.runs:
            for i in range(r.num_fragments):
                for k in range(r.fragment_size):
                    j = r.local_offset + i * r.local_stride + k
                    if not 0 <= j < len(local):
                        return False
                    local[j] += 1
        if any(c != 1 for c in local):
            return False
    for b in range(math.lcm(*(m.num_writers for m in mappings))):
        canon = [0] * size
        for m in mappings:
            if m.is_writer(b):
                for r in m.runs:
                    for i in range(r.num_fragments):
                        for k in range(r.fragment_size):
                            j = r.canonical_offset + i * r.canonical_stride + k
                            if not 0 <= j < size:
                                return False
                            canon[j] += 1
        if any(c != 1 for c in canon):
            return False
    return True


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_verify_tiling_matches_a_byte_by_byte_check(data):
    # start from a valid tiling (the page cut into one piece per rank, each
    # rank copying its piece as equal fragments), then maybe break one field
    size = 12
    cuts = sorted(data.draw(st.sets(st.integers(1, size - 1), max_size=2)))
    bounds = [0, *cuts, size]
    ranks = []
    for lo, hi in zip(bounds, bounds[1:]):
        n = data.draw(st.sampled_from([d for d in (1, 2, 3) if (hi - lo) % d == 0]))
        f = (hi - lo) // n
        ranks.append(CanonicalPageMapping(size, hi - lo, (CopyRun(0, lo, f, n, f, f),), 1, 0, True))
    if data.draw(st.booleans()):
        i = data.draw(st.integers(0, len(ranks) - 1))
        run = ranks[i].runs[0]
        field = data.draw(st.sampled_from(["local_offset", "canonical_offset", "fragment_size",
                                           "num_fragments", "local_stride", "canonical_stride",
                                           "local_page_size_bytes", "num_writers", "duplicate"]))
        delta = data.draw(st.sampled_from([-1, 1]))
        if field == "duplicate":
            ranks.append(ranks[i])
        elif field in ("local_page_size_bytes", "num_writers"):
            ranks[i] = dataclasses.replace(ranks[i], **{field: max(1, getattr(ranks[i], field) + delta)})
        else:
            run = dataclasses.replace(run, **{field: max(0, getattr(run, field) + delta)})
            ranks[i] = dataclasses.replace(ranks[i], runs=(run,))
    try:
        verify_tiling(ranks)
        ok = True
    except LayoutError:
        ok = False
    assert ok == brute_force_tiles(ranks)
    event(f"tiles: {ok}")
