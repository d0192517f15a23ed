"""Our series on vLLM's /metrics from start-up, at 0.

vLLM builds a labelled Prometheus series only when a step's stats carry it,
so before the first request a dashboard shows "no data". vLLM's API server
process asks our spec for its metric definitions (build_metric_definitions)
just before it creates the series; we then register a collector that, on
the first scrape, touches each of our series once per engine and tier
(prometheus_client shows a touched child at 0). It yields nothing itself:
vLLM's own series stay the only ones with these names.

Primed: counters (0 is true before anything happened) and the gauges whose
start value is 0; capacity_blocks and server_up are left to the first
stats (a 0 there would say "no room" / "down"). Tiers: the primary CPU
tier and the secondary tiers named in extra_config (the tiered spec's).
"""

from __future__ import annotations

import threading
from typing import Any

from kvoffload import metrics_vllm
from kvoffload.metrics import COUNTERS, GAUGES, PREFIX, TIER_LABELS

METRIC_PREFIX = "vllm:"  # vLLM's prefix on our names (convert.METRIC_PREFIX)
GAUGES_AT_ZERO = ("used_blocks", "pinned_blocks", "usage", "queue_depth", "pending_blocks", "fenced_blocks")
PRIMARY = ("cpu", "CPU", "LOCAL")
_installed = False
_lock = threading.Lock()


def tier_labels(extra_config: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(tier, medium, locality) of each tier the config builds, as its stats
    will label them; the primary only where the secondaries are not known."""
    labels = [PRIMARY]
    if str(extra_config.get("kvoffload_spec", "cpu")) != "tiered":
        return labels
    try:
        from kvoffload.tiering.spec import _tier_configs
        from kvoffload.tiering.tier import get_tier_class

        names: set[str] = set()
        for i, conf in enumerate(_tier_configs(dict(extra_config))):
            kind = conf["type"]
            name = str(conf.get("name", kind if kind not in names else f"{kind}{i}"))
            names.add(name)
            cls = get_tier_class(kind)
            labels.append((name, cls.medium.value, cls.locality.value))
    except Exception:  # a bad config fails in the engine with its own message; prime what is known
        pass
    return labels


def samples_to_prime(extra_config: dict[str, Any], vllm_names: bool) -> list[tuple[str, tuple[str, ...]]]:
    """(series name, its own label values) to show at 0."""
    tiers = tier_labels(extra_config)
    out = [(METRIC_PREFIX + PREFIX + n, t) for n in COUNTERS for t in tiers]
    out += [(METRIC_PREFIX + PREFIX + n, t) for n in GAUGES_AT_ZERO if n in GAUGES for t in tiers]
    if vllm_names:
        for i, t in enumerate(tiers):
            label = (metrics_vllm.PRIMARY_TIER if i == 0 else f"{i}:{t[0]}",)
            out += [(metrics_vllm.CHUNK_QUERIES, label), (metrics_vllm.CHUNK_HITS, label)]
            if i:
                out += [(metrics_vllm.READ_BYTES, label), (metrics_vllm.WRITE_BYTES, label)]
        out += [(n, ()) for n in (metrics_vllm.CPU_USAGE, metrics_vllm.CPU_WRITE_USAGE, metrics_vllm.CPU_READ_USAGE)]
    return out


class _Primer:
    """A collector that yields nothing; its first scrapes touch our series."""

    def __init__(self, registry, wanted: list[tuple[str, tuple[str, ...]]]):
        self.registry = registry
        self.wanted = wanted
        self.done = False

    def describe(self):
        return []  # no names: never collides with vLLM's series

    def collect(self):
        if not self.done:
            try:
                self.done = self._prime()
            except Exception:  # never break vLLM's /metrics
                self.done = True
        return []

    def _prime(self) -> bool:
        collectors = dict(self.registry._names_to_collectors)
        series = {n: collectors.get(n) for n, _ in self.wanted}
        if any(s is None for s in series.values()):
            return False  # vLLM has not made them yet: next scrape
        own = {n: len(labels) for n, labels in self.wanted}
        engines: list[tuple[str, ...]] = []
        for name, labels in self.wanted:
            metric = series[name]
            engine_names = tuple(metric._labelnames[:len(metric._labelnames) - own[name]])
            if not engines:
                engines = _engine_label_values(collectors.values(), engine_names)
                if not engines:
                    return False
            for engine in engines:
                metric.labels(*engine, *labels)
        return True


def _engine_label_values(collectors, engine_names: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The engines' label values, from a vLLM series vLLM labels per engine at start."""
    for c in collectors:
        if tuple(getattr(c, "_labelnames", ())) == engine_names and getattr(c, "_metrics", None):
            return [tuple(k) for k in list(c._metrics)]
    return []


def install(extra_config: dict[str, Any], vllm_names: bool) -> None:
    """Once per process (vLLM's API server, where its series live)."""
    global _installed
    with _lock:
        if _installed:
            return
        try:
            import prometheus_client
        except ImportError:
            return
        prometheus_client.REGISTRY.register(_Primer(prometheus_client.REGISTRY,
                                                    samples_to_prime(extra_config, vllm_names)))
        _installed = True
