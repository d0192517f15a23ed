"""vLLM types <-> kvoffload types. Keys need nothing: both are
block-hash bytes + 4-byte big-endian group index. Enums map by value."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from typing import Any

from kvoffload import abstractions as ko
from kvoffload.config import CacheConfig, ConfigError, KVGroupConfig, OffloadingConfig
from kvoffload.layout import ATTENTION, MLA
from kvoffload.integrations.vllm._compat import OffloadingConnectorStats, vbase
from kvoffload import metrics_vllm
from kvoffload.metrics import COUNTERS, GAUGES, PREFIX

# extra_config keys vLLM itself consumes; everything else is ours, checked by our spec.
VLLM_OWNED_KEYS = frozenset({
    "spec_name", "spec_module_path", "block_size", "blocks_per_chunk",
    "canonical_layout", "sync_load_budget_bytes",
})
# Which kvoffload spec (name in kvoffload.spec's registry) to build.
SPEC_KEY = "kvoffload_spec"
# Inside vLLM our series join vLLM's namespace: vllm:kvoffload_hits{tier=...}
# (vLLM's LLM.get_metrics() also only reports vllm:* series).
METRIC_PREFIX = "vllm:"

# ours -> vLLM's; public for the adapter's lookup (one call per block: no extra call layer)
LOOKUP_RESULTS = {r: vbase.LookupResult[r.name] for r in ko.LookupResult}
_POLICY = {p: vbase.OffloadPolicy(p.value) for p in ko.OffloadPolicy}
_MEDIUM = {m: vbase.Medium(m.value) for m in ko.Medium}
_LOCALITY = {loc: vbase.Locality(loc.value) for loc in ko.Locality}


# ---- config -----------------------------------------------------------------

def layer_kind(spec: Any) -> tuple[str, int | None]:
    """(our kind, sliding window in tokens or None) of one vLLM KVCacheSpec."""
    from vllm.v1 import kv_cache_interface as kvi

    if isinstance(spec, kvi.MambaSpec):
        return "mamba", None
    if isinstance(spec, kvi.SlidingWindowSpec):  # SlidingWindowMLASpec too
        return (MLA if isinstance(spec, kvi.SlidingWindowMLASpec) else ATTENTION), spec.sliding_window
    if isinstance(spec, kvi.MLAAttentionSpec):  # before FullAttentionSpec, its base
        return ("indexer" if spec.cache_role is kvi.SparseCacheRole.INDEXER else MLA), None
    if isinstance(spec, kvi.ChunkedLocalAttentionSpec):  # never looks back past its chunk
        return ATTENTION, spec.attention_chunk_size
    if isinstance(spec, kvi.FullAttentionSpec):
        return ATTENTION, None
    return f"vllm:{type(spec).__name__}", None  # unknown to us: the spec refuses it


def group_kind(layer_specs: Mapping[str, Any]) -> tuple[str, int | None, tuple[str, ...]]:
    """(kind, sliding window, layer names) of one KV group from its layers'
    vLLM specs (a UniformTypeKVCacheSpecs group mixes them, e.g. MLA and
    its sparse indexer): a layer we cannot offload decides the kind, and
    the names are then those layers'."""
    kinds = {name: layer_kind(spec) for name, spec in layer_specs.items()}
    for kind, _ in kinds.values():
        if kind not in (ATTENTION, MLA):
            return kind, None, tuple(n for n, (k, _) in kinds.items() if k == kind)
    windows = [w for _, w in kinds.values()]
    window = None if None in windows or not windows else max(windows)
    kind = MLA if kinds and all(k == MLA for k, _ in kinds.values()) else ATTENTION
    return kind, window, tuple(layer_specs)


def model_layer_specs(layer_names: tuple[str, ...]) -> dict[str, Any]:
    """Each named layer's vLLM KVCacheSpec, split out of UniformTypeKVCacheSpecs,
    from the model vLLM is loading in this process; {} where there is none
    (the scheduler's process: its spec learns no kinds, the workers' refuse)."""
    from vllm.config import get_current_vllm_config_or_none, get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    cfg = get_current_vllm_config_or_none()
    if cfg is None:
        return {}
    out = {}
    for name, layer in get_layers_from_vllm_config(cfg, AttentionLayerBase, layer_names).items():
        spec = layer.get_kv_cache_spec(cfg)
        if spec is not None:
            out[name] = spec
    return out


def default_shared_pool_path(vconfig: Any) -> str:
    """Where the TP ranks of one engine (and DP rank) share their host pool:
    on /dev/shm (memory, not disk) when there is one; the engine id makes it
    this run's own."""
    where = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(where, f"kvoffload-{vconfig.engine_id}-dp{vconfig.parallel.data_parallel_index}.pool")


def offloading_config(vconfig: Any, spec_keys: tuple[str, ...] = (),
                      layer_specs: Mapping[str, Any] | None = None,
                      shared_pool: bool = False) -> OffloadingConfig:
    """Our OffloadingConfig from vLLM's. spec_keys: the extra_config keys our
    spec accepts; what vLLM knows and the user left out is filled in for them:
    the chunk size (the scheduler-side manager is built before any KV cache
    exists, maybe in another process) and the namespace of persistent tiers.
    shared_pool: the workers' host pool is shared through a file (tensor
    parallelism, or a scheduler in another process than its worker).
    layer_specs (layer name -> vLLM KVCacheSpec), where known, give each
    group its kind and sliding window."""
    extra = {k: v for k, v in dict(vconfig.extra_config).items()
             if k not in VLLM_OWNED_KEYS and k not in (SPEC_KEY, metrics_vllm.OPTION)}
    bpc = vconfig.cache.blocks_per_chunk
    sizes = ("kv_bytes_per_chunk", "kv_bytes_per_token", "num_cpu_chunks")
    # vLLM's bytes per block span all groups; ours are per chunk of one group,
    # so they agree only for one group (else the worker, if in this process,
    # measures it, or the user declares it).
    # Under TP a rank's bytes are only its share of a canonical chunk: the
    # scheduler then reads the chunk size from the shared pool's header.
    tp = vconfig.parallel.world_size > 1
    if ("kv_bytes_per_chunk" in spec_keys and not any(k in extra for k in sizes) and not tp
            and len(vconfig.groups) == 1 and vconfig.worker_kv_bytes_per_block > 0):
        extra["kv_bytes_per_chunk"] = vconfig.worker_kv_bytes_per_block * bpc
    if (tp or shared_pool) and "shared_pool_path" in spec_keys:
        extra.setdefault("shared_pool_path", default_shared_pool_path(vconfig))
    if "tp_size" in spec_keys:  # the namespace keeps each rank's opaque pages apart
        extra.setdefault("tp_size", vconfig.parallel.tp_size)
        extra.setdefault("tp_rank", vconfig.parallel.rank % vconfig.parallel.tp_size)
    if "namespace" in spec_keys:
        ns = extra.get("namespace")
        if ns is not None and not isinstance(ns, Mapping):  # dict() would take 5 as a TypeError, pairs as a dict
            raise ConfigError(f"namespace must be a mapping, got {ns!r}")
        ns = dict(ns or {})
        ns.setdefault("model", vconfig.model.name)
        ns.setdefault("dtype", vconfig.model.dtype)
        layout = getattr(vconfig, "kv_cache_layout", None)
        if layout:
            ns.setdefault("layout", f"vllm:{layout}")
        extra["namespace"] = ns
    groups = []
    for g in vconfig.groups:
        # 0.33 bounds sliding windows in chunks; 0.32 does not say (full attention).
        window_chunks = getattr(g, "sliding_window_size_in_chunks", None)
        window = window_chunks * g.tokens_per_block * bpc if window_chunks else None
        kind, names = ATTENTION, tuple(g.layer_names)
        specs = {n: layer_specs[n] for n in g.layer_names if n in (layer_specs or {})}
        if specs:
            kind, window, names = group_kind(specs)
        groups.append(KVGroupConfig(g.tokens_per_block, window, kind, names))
    config = OffloadingConfig(
        groups=tuple(groups),
        cache=CacheConfig(vconfig.cache.tokens_per_hash, bpc),
        extra_config=extra,
        enable_kv_cache_events=bool(vconfig.enable_kv_cache_events),
    )
    return config


# ---- scheduler side ---------------------------------------------------------

def tier_filter(vfilter: Any) -> ko.TierFilter:
    """vLLM's parse of a request's kv_load_tiers as ours. Never raises (it is
    client data, read in the scheduler): a medium or locality we do not know
    gives ALL; the tiered manager replaces the filter with its own parse of
    kv_load_tiers (kvoffload.hints) anyway."""
    if vfilter is vbase.TierFilter.ALL:
        return ko.TierFilter.ALL
    try:
        return ko.TierFilter(tuple(
            ko.TierMatcher(ko.Medium(m.medium.value) if m.medium is not None else None,
                           ko.Locality(m.locality.value) if m.locality is not None else None)
            for m in vfilter.matchers
        ))
    except ValueError:  # a newer vLLM's medium or locality
        return ko.TierFilter.ALL


def req_context(vctx: Any) -> ko.ReqContext | None:
    """Our ReqContext for a vLLM one, made once and kept in its state.
    Key positions are shared (same dict), not copied."""
    if vctx is None:
        return None
    ctx = vctx.get_state(ko.ReqContext)
    if ctx is None:
        ctx = ko.ReqContext(vctx.req_id, vctx.kv_transfer_params, vctx.kv_hints,
                            tier_filter(vctx.load_tier_filter))
        # vLLM offers only per-key get_offload_key_position; our managers order
        # a whole prefix, so they share its dict (private: no public way to it).
        ctx.share_offload_key_positions(vctx._offload_key_positions)
        vctx.set_state(ctx)
    return ctx


def lookup_result(r: ko.LookupResult) -> Any:
    return LOOKUP_RESULTS[r]


def request_offloading_context(c: ko.RequestOffloadingContext) -> Any:
    return vbase.RequestOffloadingContext(policy=_POLICY[c.policy])


def prepare_store_output(out: ko.PrepareStoreOutput | None) -> Any:
    if out is None:
        return None
    return vbase.PrepareStoreOutput(out.keys_to_store, out.store_spec, out.evicted_keys)


def schedule_end_context(c: Any) -> ko.ScheduleEndContext:
    return ko.ScheduleEndContext(c.new_req_ids, c.preempted_req_ids)


# 0.33's events tracker takes a failed store's cleanup as a metadata-only
# removal; 0.32 has no such field and would announce it as BlockRemoved.
HAS_METADATA_ONLY = "metadata_only" in getattr(vbase.OffloadingEvent, "__dataclass_fields__", {})


def event(e: ko.OffloadingEvent) -> Any:
    """vLLM's OffloadingEvent, or None for one this vLLM must not see."""
    if e.metadata_only and not HAS_METADATA_ONLY:
        return None
    extra = {"metadata_only": True} if e.metadata_only else {}
    return vbase.OffloadingEvent(
        keys=e.keys, medium=_MEDIUM[e.medium], removed=e.removed,
        locality=_LOCALITY[e.locality] if e.locality is not None else None,
        ownership=e.ownership, removal_expected=e.removal_expected, **extra,
    )


def metric_definitions(defs: dict[str, ko.OffloadingMetricMetadata], vllm_names: bool = False) -> dict[str, Any]:
    """Our metric metadata as vLLM's classes (vLLM builds the Prometheus series);
    vllm_names: with vLLM's own names for what we share (metrics_vllm)."""
    named = {METRIC_PREFIX + n: m for n, m in defs.items()}
    if vllm_names:
        named.update(metrics_vllm.definitions(inside_vllm=True))
    out: dict[str, Any] = {}
    for name, m in named.items():
        if isinstance(m, ko.OffloadingHistogramMetadata):
            out[name] = vbase.OffloadingHistogramMetadata(
                documentation=m.documentation, labelnames=m.labelnames, buckets=m.buckets)
        elif isinstance(m, ko.OffloadingGaugeMetadata):
            out[name] = vbase.OffloadingGaugeMetadata(documentation=m.documentation, labelnames=m.labelnames)
        else:
            out[name] = vbase.OffloadingCounterMetadata(documentation=m.documentation, labelnames=m.labelnames)
    return out


def connector_stats(stats: ko.OffloadingStats | None, vllm_names: bool = False) -> Any:
    """Our nested per-tier stats as one vLLM OffloadingConnectorStats, one
    labelled series per tier (and vLLM's own names, with vllm_names). Names
    vLLM was not told about are left out (vLLM refuses undeclared series)."""
    if stats is None:
        return None
    out = OffloadingConnectorStats()
    for s in stats.walk():
        labels = (s.tier, s.medium.value if s.medium else "",
                  s.locality.value if s.locality else "")
        for name, value in s.counters.items():
            if name in COUNTERS and value:
                out.increase_counter(METRIC_PREFIX + PREFIX + name, value, labels)
        for name, value in s.gauges.items():
            if name in GAUGES:
                out.set_gauge(METRIC_PREFIX + PREFIX + name, value, labels)
    if vllm_names:
        for name, labels, value, counter in metrics_vllm.from_stats(stats, inside_vllm=True):
            if not counter:
                out.set_gauge(name, value, labels)
            elif value:
                out.increase_counter(name, value, labels)
    return out


# ---- worker side ------------------------------------------------------------

def gpu_spec(v: Any) -> ko.GPULoadStoreSpec:
    return ko.GPULoadStoreSpec(v.block_ids, v.group_sizes, v.block_indices)


def _page_mapping(m: Any) -> ko.CanonicalPageMapping | None:
    if m is None:
        return None
    runs = tuple(ko.CopyRun(r.local_offset, r.canonical_offset, r.fragment_size,
                            r.num_fragments, r.local_stride, r.canonical_stride) for r in m.runs)
    return ko.CanonicalPageMapping(m.canonical_page_size_bytes, m.local_page_size_bytes, runs,
                                   m.num_writers, m.writer_index, m.parallelism_agnostic)


def kv_caches(v: Any) -> ko.CanonicalKVCaches:
    """vLLM's canonical KV caches (int8 (num_blocks, page) views, the same
    tensors, no copy) as ours."""
    return ko.CanonicalKVCaches(
        tensors=[ko.CanonicalKVCacheTensor(t.tensor, t.page_size_bytes) for t in v.tensors],
        group_data_refs=[[ko.CanonicalKVCacheRef(r.tensor_idx, r.page_size_bytes, _page_mapping(r.mapping))
                          for r in refs] for refs in v.group_data_refs],
    )


def transfer_result(r: ko.TransferResult) -> Any:
    return vbase.TransferResult(r.job_id, r.success, r.transfer_size, r.transfer_time)
