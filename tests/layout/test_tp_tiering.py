"""Persisted blocks keep their parallel layout: the tiered spec puts the
pages' parallel layout (from the KV caches' mappings) in the storage
namespace, so an opaque per-rank page on disk is only served to the same
TP rank and size, and canonical pages to any layout."""

import pytest
import torch
from layout_ref import canonical_kv_caches, full_cache, rows, shard

from kvoffload.abstractions import (
    GPULoadStoreSpec,
    LookupResult,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from kvoffload.config import ConfigError, OffloadingConfig
from kvoffload.layout import LayerLayout, ParallelLayout
from kvoffload.tiering import TieredOffloadingSpec

END = ScheduleEndContext((), ())
KEYS = [make_offload_key(bytes([i]) * 8, 0) for i in range(3)]
UNEVEN = LayerLayout(16, 3, 32, torch.float16)  # 3 KV heads over 2 ranks: no mapping, opaque pages
EVEN = LayerLayout(16, 2, 32, torch.float16)


def engine(layer, par, seed=0):
    """A rank's engine tensor: its shard, or for UNEVEN two heads' worth of bytes."""
    if layer is UNEVEN:
        g = torch.Generator().manual_seed(seed + par.tp_rank)
        return torch.randint(-1000, 1000, (8, 2, 16, 2, 32), generator=g).to(torch.float16)
    return shard(full_cache(layer, 8, seed=seed), layer, par)


def spec_for(tmp_path, layer, par, **ns):
    tensor = engine(layer, par)
    kv = canonical_kv_caches([(tensor, layer)], [[0]], par)
    page = tensor[0].numel() * 2
    chunk = kv.group_data_refs[0][0].mapping.canonical_page_size_bytes
    assert chunk >= page
    config = OffloadingConfig.from_dict({"groups": [16], "extra_config": {
        "num_cpu_chunks": 6, "kv_bytes_per_chunk": chunk, "tp_rank": par.tp_rank, "tp_size": par.tp_size,
        "namespace": {"model": "m", **ns}, "promotion_deadline_s": None,
        "secondary_tiers": [{"type": "storage", "path": str(tmp_path / "kv"), "capacity_bytes": "256KiB",
                             "direct_io": False}]}})
    spec = TieredOffloadingSpec(config)  # opens the storage tier now: the chunk size is declared
    worker = spec.get_worker(kv)
    return spec, spec.get_manager(), worker, tensor


def run(worker, job, submit, *args):
    assert submit(job, *args), worker.last_error
    worker.wait({job})
    assert all(r.success for r in worker.get_finished())


def store_all(tmp_path, layer, par):
    spec, mgr, worker, tensor = spec_for(tmp_path, layer, par)
    ctx = ReqContext("store")
    mgr.on_new_request(ctx)
    out = mgr.prepare_store(KEYS, ctx)
    run(worker, 1, worker.submit_store, GPULoadStoreSpec([5, 6, 7]), out.store_spec)
    mgr.complete_store(KEYS, ctx)
    mgr.on_schedule_end(END)
    mgr.wait_idle()
    assert mgr.get_stats().children[1].counters.get("stored_blocks") == 3  # on disk
    namespace = spec.namespace()
    mgr.shutdown()
    worker.shutdown()
    return namespace, rows(tensor)[5:8].clone()


def lookups(tmp_path, layer, par):
    """A new engine on the same directory: what it finds, and the bytes it loads."""
    spec, mgr, worker, tensor = spec_for(tmp_path, layer, par)
    ctx = ReqContext("load")
    mgr.on_new_request(ctx)
    found = [mgr.lookup(k, ctx) for k in KEYS]
    loaded = None
    if found[0] is LookupResult.HIT_PENDING:
        mgr.on_schedule_end(END)
        mgr.wait_idle()
        assert [mgr.lookup(k, ctx) for k in KEYS] == [LookupResult.HIT] * 3
        tensor.zero_()
        run(worker, 2, worker.submit_load, mgr.prepare_load(KEYS, ctx), GPULoadStoreSpec([0, 1, 2]))
        mgr.complete_load(KEYS, ctx)
        loaded = rows(tensor)[:3].clone()
    mgr.shutdown()
    worker.shutdown()
    return found, loaded


def test_opaque_pages_on_disk_are_served_only_to_the_same_rank_and_size(tmp_path):
    ns, stored = store_all(tmp_path, UNEVEN, ParallelLayout(0, 2))
    assert ns.parallel_layout == "tp2-rank0"
    for other in (ParallelLayout(1, 2), ParallelLayout(0, 4)):  # other rank, other TP size
        found, _ = lookups(tmp_path, UNEVEN, other)
        assert found == [LookupResult.MISS] * 3
    found, loaded = lookups(tmp_path, UNEVEN, ParallelLayout(0, 2))
    assert found == [LookupResult.HIT_PENDING] * 3
    assert torch.equal(loaded, stored)


def test_canonical_pages_are_agnostic_and_a_rank_s_partial_pages_are_not(tmp_path):
    # TP=1: the canonical page whole; the tier opened as "tp1-rank0" is reopened as "agnostic"
    ns, stored = store_all(tmp_path, EVEN, ParallelLayout(0, 1))
    assert ns.parallel_layout == "agnostic"
    found, loaded = lookups(tmp_path, EVEN, ParallelLayout(0, 1))
    assert found == [LookupResult.HIT_PENDING] * 3 and torch.equal(loaded, stored)
    # a TP=2 rank with a pool of its own fills only its heads of each page: kept apart
    found, _ = lookups(tmp_path, EVEN, ParallelLayout(1, 2))
    assert found == [LookupResult.MISS] * 3


def test_a_declared_parallel_layout_must_match_the_pages(tmp_path):
    with pytest.raises(ConfigError, match=r"parallel_layout='agnostic'.*'tp2-rank1'"):
        spec_for(tmp_path, UNEVEN, ParallelLayout(1, 2), parallel_layout="agnostic")
    spec, mgr, worker, _ = spec_for(tmp_path, UNEVEN, ParallelLayout(1, 2), parallel_layout="tp2-rank1")
    assert spec.namespace().parallel_layout == "tp2-rank1"
    mgr.shutdown()
    worker.shutdown()


def test_bad_tp_rank_is_refused():
    with pytest.raises(ConfigError, match=r"tp_rank must be an integer in \[0, tp_size=2\), got 2"):
        TieredOffloadingSpec(OffloadingConfig.from_dict({"groups": [16], "extra_config": {
            "num_cpu_chunks": 4, "tp_rank": 2, "tp_size": 2}}))
