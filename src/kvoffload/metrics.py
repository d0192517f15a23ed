"""Prometheus metrics for every tier, all named `kvoffload_*`.

Managers report OffloadingStats (counter deltas + gauges, nested per tier);
workers report TransferResults. PrometheusMetrics turns both into labelled
prometheus_client series (labels: tier, medium, locality; transfers also by
direction), on a registry of your choice: its own, the default one, or the
engine's (pass `registry=`), and can serve them over HTTP. Alongside, vLLM's
own names for what we share with its native offloading (metrics_vllm).
"""

from __future__ import annotations

from typing import Any

from kvoffload.abstractions import (
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
    OffloadingMetricMetadata,
    OffloadingStats,
)
from kvoffload import metrics_vllm

PREFIX = "kvoffload_"
TIER_LABELS = ("tier", "medium", "locality")

COUNTERS = {
    "lookups": "Lookups answered by the tier",
    "hits": "Lookups that found a readable block",
    "misses": "Lookups that found nothing",
    "hits_pending": "Lookups that found a block not yet readable",
    "retries": "Lookups answered RETRY (answer not known yet)",
    "stored_blocks": "Blocks stored into the tier",
    "stored_bytes": "Bytes stored into the tier",
    "loaded_blocks": "Blocks loaded from the tier",
    "loaded_bytes": "Bytes loaded from the tier",
    "evictions": "Blocks evicted to make room",
    "allocation_failures": "Stores refused because no room could be made",
    "dropped_stores": "Blocks not stored: a failed store, or a write down refused by the tier or past its wait queue",
    "checksum_failures": "Blocks whose checksum did not match (served as misses)",
    "errors": "Transfer or connection errors (degraded to misses)",
    "bad_request_hints": "Invalid per-request hints (kv_transfer_params) ignored",
    # a secondary tier under the CPU tier (tiering/)
    "promoted_blocks": "Blocks promoted from this tier into the CPU tier",
    "promotion_failures": "Blocks whose promotion into the CPU tier failed (answered as misses)",
    "promotion_timeouts": "Lookups answered MISS because the request's promotion took longer than promotion_deadline_s",
    "cascaded_blocks": "Blocks written down from the CPU tier into this tier",
    "failed_stores": "Blocks whose write down from the CPU tier into this tier failed",
    "partial_stores": "Stores larger than the CPU tier's room, of which only the head was stored",
    "store_blocks_cut": "New blocks past the CPU tier's room in a head store (never offered again)",
    "store_blocks_declined": "New blocks the eviction policy chose not to store (never offered again)",
    "cascade_deferred": "Blocks whose write down from the CPU tier waited for the tier to catch up",
    "cascade_missed": "Blocks evicted from the CPU tier before their deferred write down",
    # remote stores (Redis/Valkey, Mooncake)
    "lookup_timeouts": "Lookups answered MISS because the store did not answer within lookup_deadline_s",
    "stores_refused": "Blocks not stored because the store was down (backing off)",
    "store_queue_full": "Stores refused because the worker's queue was full",
    "store_failures": "Blocks a store failed to write (network or server error)",
    "load_failures": "Blocks a load failed to read (network or server error, missing or corrupt)",
    "load_misses": "Blocks a load found gone from the store (evicted or expired)",
    "reconnects": "Reconnections to the store after an outage",
    "wrong_key_values": "Values found under another key's name (copied or foreign): deleted, a miss",
    "wrong_type_keys": "Keys holding another Redis type (list, hash, ...): deleted, a miss",
    "mac_failures": "Values whose MAC did not verify (another key, or tampered with): deleted, a miss",
    # storage
    "index_bad_records": "Records of the storage index found bad at start-up (their blocks are dropped)",
}
GAUGES = {
    "used_blocks": "Blocks held by the tier",
    "capacity_blocks": "Blocks the tier can hold",
    "pinned_blocks": "Blocks pinned by in-flight loads or stores",
    "usage": "Share of the tier's capacity in use (0..1)",
    "queue_depth": "Transfer jobs queued or in flight",
    "cascade_waiting": "Blocks waiting to be written down from the CPU tier into this tier",
    "pending_blocks": "Blocks reserved by stores not yet complete",
    "fenced_blocks": "Freed blocks held back until in-flight jobs of a cache reset finished",
    "known_present": "Keys a remote store answered present, still trusted (lookup_cache_s)",
    "server_up": "1 while the remote store answers, 0 while backing off after an error",
    "uncommitted_records": "Storage index records not on disk yet: stores a kill -9 now would lose",
}
BYTES_BUCKETS = tuple(float(2**i) for i in range(12, 33, 2))  # 4 KiB .. 4 GiB
SECONDS_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0)


def build_metric_definitions(extra_config: dict[str, Any] | None = None) -> dict[str, OffloadingMetricMetadata]:
    """Every series kvoffload emits, by full name (the spec's contract)."""
    defs: dict[str, OffloadingMetricMetadata] = {}
    for name, doc in COUNTERS.items():
        defs[PREFIX + name] = OffloadingCounterMetadata(doc, TIER_LABELS)
    for name, doc in GAUGES.items():
        defs[PREFIX + name] = OffloadingGaugeMetadata(doc, TIER_LABELS)
    defs[PREFIX + "transfer_bytes"] = OffloadingHistogramMetadata(
        "Bytes per transfer job", TIER_LABELS + ("direction",), BYTES_BUCKETS)
    defs[PREFIX + "transfer_seconds"] = OffloadingHistogramMetadata(
        "Seconds per transfer job", TIER_LABELS + ("direction",), SECONDS_BUCKETS)
    defs[PREFIX + "config"] = OffloadingGaugeMetadata("Configuration of this instance (value 1)", ())
    return defs


class PrometheusMetrics:
    """prometheus_client series fed from OffloadingStats and TransferResults."""

    def __init__(self, registry=None, config_info: dict[str, Any] | None = None, vllm_names: bool = True):
        try:
            import prometheus_client as prom
        except ImportError as e:
            raise ImportError("metrics need prometheus_client: pip install kvoffload[metrics]") from e
        self._prom = prom
        self.registry = registry if registry is not None else prom.CollectorRegistry()
        self._series: dict[str, Any] = {}
        for full, meta in build_metric_definitions().items():
            if full == PREFIX + "config":
                continue
            self._series[full] = self._make(full, meta)
        self.vllm_names = vllm_names
        if vllm_names:
            for full, meta in metrics_vllm.definitions(inside_vllm=False).items():
                self._series[full] = self._make(full, meta)
            for tt in metrics_vllm.TRANSFER_TYPE.values():  # both directions from the start, as vLLM
                for n in (metrics_vllm.TOTAL_BYTES, metrics_vllm.TOTAL_TIME, metrics_vllm.SIZE):
                    self._series[n].labels(tt)
        if config_info:
            info = prom.Info(PREFIX + "config", "Configuration of this instance", registry=self.registry)
            info.info({k: str(v) for k, v in sorted(config_info.items())})

    def _make(self, full: str, meta: OffloadingMetricMetadata):
        prom = self._prom
        name = full
        if isinstance(meta, OffloadingHistogramMetadata):
            return prom.Histogram(name, meta.documentation, meta.labelnames,
                                  buckets=meta.buckets or prom.Histogram.DEFAULT_BUCKETS,
                                  registry=self.registry)
        if isinstance(meta, OffloadingCounterMetadata):
            # prometheus_client adds the _total suffix itself
            return prom.Counter(name, meta.documentation, meta.labelnames, registry=self.registry)
        return prom.Gauge(name, meta.documentation, meta.labelnames, registry=self.registry)

    def _series_for(self, name: str, counter: bool):
        full = PREFIX + name
        s = self._series.get(full)
        if s is None:  # a tier reported a stat we have no definition for: still export it
            meta = (OffloadingCounterMetadata if counter else OffloadingGaugeMetadata)(
                f"kvoffload stat {name}", TIER_LABELS)
            s = self._series[full] = self._make(full, meta)
        return s

    def record_stats(self, stats: OffloadingStats | None) -> None:
        """Add one get_stats() result (counter deltas, current gauges), all tiers."""
        if stats is None:
            return
        for st in stats.walk():
            labels = (st.tier, st.medium.value if st.medium else "",
                      st.locality.value if st.locality else "")
            for name, delta in st.counters.items():
                child = self._series_for(name, True).labels(*labels)  # a 0 series from the start
                if delta:
                    child.inc(delta)
            for name, value in st.gauges.items():
                self._series_for(name, False).labels(*labels).set(value)
        if self.vllm_names:
            for name, labels, value, counter in metrics_vllm.from_stats(stats, inside_vllm=False):
                child = self._series[name].labels(*labels) if labels else self._series[name]
                if not counter:
                    child.set(value)
                elif value:
                    child.inc(value)

    def observe_transfer(self, tier: str, direction: str, nbytes: int | None, seconds: float | None,
                         medium: str = "", locality: str = "") -> None:
        labels = (tier, medium, locality, direction)
        if nbytes is not None:
            self._series[PREFIX + "transfer_bytes"].labels(*labels).observe(nbytes)
        if seconds is not None:
            self._series[PREFIX + "transfer_seconds"].labels(*labels).observe(seconds)
        tt = metrics_vllm.TRANSFER_TYPE.get(direction)
        if self.vllm_names and tt is not None:  # GPU <-> CPU, under vLLM's names
            b, t, s = (self._series[n] for n in metrics_vllm.transfer_names(direction))
            if nbytes is not None:
                b.inc(nbytes)
                s.observe(nbytes)
                self._series[metrics_vllm.TOTAL_BYTES].labels(tt).inc(nbytes)
                self._series[metrics_vllm.SIZE].labels(tt).observe(nbytes)
            if seconds is not None:
                t.inc(seconds)
                self._series[metrics_vllm.TOTAL_TIME].labels(tt).inc(seconds)

    def serve(self, port: int = 0, addr: str = "127.0.0.1") -> int:
        """Serve /metrics over HTTP in a background thread; returns the port."""
        server, _thread = self._prom.start_http_server(port, addr=addr, registry=self.registry)
        self._server = server
        return server.server_address[1]

    def close(self) -> None:
        server = getattr(self, "_server", None)
        if server is not None:
            server.shutdown()
            server.server_close()
            self._server = None

    def text(self) -> str:
        return self._prom.generate_latest(self.registry).decode()
