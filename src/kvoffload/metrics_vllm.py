"""vLLM's own Prometheus names for what kvoffload shares with vLLM's native
offloading (its CPUOffloadingSpec and TieringOffloadingSpec), so a user who
switches keeps their dashboards. Emitted alongside our kvoffload_* series;
on by default, off with extra_config {"vllm_metric_names": false} inside
vLLM or `PrometheusMetrics(vllm_names=False)` / `--no-vllm-metric-names`.

Names, types and labels are vLLM 0.32's and 0.33's (identical for these):
  per tier, label tier="0:primary" | "<i>:<secondary tier>" (vLLM's labels):
    vllm:kv_offload_tiering_chunk_queries   counter  hits + misses (resolved lookups)
    vllm:kv_offload_tiering_chunk_hits      counter
    vllm:kv_offload_tiering_read_bytes      counter  secondary tiers: bytes promoted from it
    vllm:kv_offload_tiering_write_bytes     counter  secondary tiers: bytes cascaded into it
  CPU tier (the primary), no label:
    vllm:kv_offload_cpu_cache_usage_perc / _write_usage_perc / _read_usage_perc  gauges:
        share of the CPU cache pinned by in-flight transfers (all / stores / loads)
  GPU <-> CPU transfers, no label (inside vLLM, vLLM counts these itself from
  our workers' TransferResults; emitted here only outside vLLM):
    vllm:kv_offload_load_bytes, _load_time, _store_bytes, _store_time  counters
    vllm:kv_offload_load_size, _store_size                            histograms
    vllm:kv_offload_allocation_failure                                counter
    vllm:kv_offload_total_bytes, _total_time  counters, label transfer_type
    vllm:kv_offload_size                      histogram, label transfer_type
        (vLLM's deprecated names; transfer_type "CPU_to_GPU" | "GPU_to_CPU")
"""

from __future__ import annotations

from collections.abc import Iterator

from kvoffload.abstractions import (
    Medium,
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
    OffloadingMetricMetadata,
    OffloadingStats,
)

OPTION = "vllm_metric_names"  # extra_config key (inside vLLM); default on
PRIMARY_TIER = "0:primary"  # vLLM's tier label of the primary (CPU) tier
TRANSFER_TYPE = {"load": "CPU_to_GPU", "store": "GPU_to_CPU"}
# vLLM's buckets for transfer sizes, in bytes
TRANSFER_SIZE_BUCKETS = (1e6, 5e6, 10e6, 20e6, 40e6, 60e6, 80e6, 100e6, 150e6, 200e6)

_T = "vllm:kv_offload_tiering_"
CHUNK_QUERIES, CHUNK_HITS = _T + "chunk_queries", _T + "chunk_hits"
READ_BYTES, WRITE_BYTES = _T + "read_bytes", _T + "write_bytes"
CPU_USAGE = "vllm:kv_offload_cpu_cache_usage_perc"
CPU_WRITE_USAGE = "vllm:kv_offload_cpu_cache_write_usage_perc"
CPU_READ_USAGE = "vllm:kv_offload_cpu_cache_read_usage_perc"
ALLOCATION_FAILURE = "vllm:kv_offload_allocation_failure"
TOTAL_BYTES, TOTAL_TIME, SIZE = "vllm:kv_offload_total_bytes", "vllm:kv_offload_total_time", "vllm:kv_offload_size"


def transfer_names(direction: str) -> tuple[str, str, str]:
    """(bytes, time, size) names of one direction: vllm:kv_offload_load_*."""
    p = f"vllm:kv_offload_{direction}_"
    return p + "bytes", p + "time", p + "size"


def enabled(extra_config: dict | None) -> bool:
    value = (extra_config or {}).get(OPTION, True)
    if not isinstance(value, bool):
        from kvoffload.config import ConfigError

        raise ConfigError(f"{OPTION} must be true or false, got {value!r}")
    return value


def definitions(inside_vllm: bool) -> dict[str, OffloadingMetricMetadata]:
    """The vLLM-named series we emit. Inside vLLM, leave out what vLLM's
    connector declares and fills itself (declaring it twice would fail)."""
    tier = ("tier",)
    defs: dict[str, OffloadingMetricMetadata] = {
        CHUNK_QUERIES: OffloadingCounterMetadata("Resolved (hit or miss) chunk lookups, by tier", tier),
        CHUNK_HITS: OffloadingCounterMetadata("Chunk lookups that hit, by tier", tier),
        READ_BYTES: OffloadingCounterMetadata("Bytes promoted from a secondary tier", tier),
        WRITE_BYTES: OffloadingCounterMetadata("Bytes cascaded into a secondary tier", tier),
        CPU_USAGE: OffloadingGaugeMetadata("Share of the CPU cache pinned by in-flight transfers"),
        CPU_WRITE_USAGE: OffloadingGaugeMetadata("Share of the CPU cache pinned by in-flight stores"),
        CPU_READ_USAGE: OffloadingGaugeMetadata("Share of the CPU cache pinned by in-flight loads"),
    }
    if inside_vllm:
        return defs
    for direction, what in (("load", "loaded from offload storage to GPU"),
                            ("store", "stored from GPU to offload storage")):
        b, t, s = transfer_names(direction)
        defs[b] = OffloadingCounterMetadata(f"Total bytes {what}")
        defs[t] = OffloadingCounterMetadata(f"Total seconds of transfers {what}")
        defs[s] = OffloadingHistogramMetadata(f"Bytes per transfer {what}", (), TRANSFER_SIZE_BUCKETS)
    defs[ALLOCATION_FAILURE] = OffloadingCounterMetadata("Stores refused because no CPU room could be made")
    tt = ("transfer_type",)
    defs[TOTAL_BYTES] = OffloadingCounterMetadata("Number of bytes offloaded by KV connector", tt)
    defs[TOTAL_TIME] = OffloadingCounterMetadata("Total time measured by all KV offloading operations", tt)
    defs[SIZE] = OffloadingHistogramMetadata("Histogram of KV offload transfer size, in bytes.", tt,
                                             TRANSFER_SIZE_BUCKETS)
    return defs


# (name, label values, value, is_counter)
Sample = tuple[str, tuple[str, ...], float, bool]


def from_stats(stats: OffloadingStats, inside_vllm: bool) -> Iterator[Sample]:
    """vLLM-named samples of one get_stats() result (counter deltas, gauges).
    A composing manager's children are its tiers, the primary first."""
    tiers = stats.children or [stats]
    for i, st in enumerate(tiers):
        label = (PRIMARY_TIER if i == 0 else f"{i}:{st.tier}",)
        c = st.counters
        hits = c.get("hits", 0)
        yield CHUNK_QUERIES, label, hits + c.get("misses", 0), True
        yield CHUNK_HITS, label, hits, True
        if i:
            yield READ_BYTES, label, c.get("loaded_bytes", 0), True
            yield WRITE_BYTES, label, c.get("stored_bytes", 0), True
    primary = tiers[0]
    g = primary.gauges
    cap = g.get("capacity_blocks")
    if primary.medium is Medium.CPU and cap:
        pending, pinned = g.get("pending_blocks", 0), g.get("pinned_blocks", 0)
        yield CPU_USAGE, (), (pending + pinned) / cap, False
        yield CPU_WRITE_USAGE, (), pending / cap, False
        yield CPU_READ_USAGE, (), pinned / cap, False
    if not inside_vllm:
        yield ALLOCATION_FAILURE, (), primary.counters.get("allocation_failures", 0), True
