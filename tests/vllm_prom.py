"""vLLM's own Prometheus side of the offloading connector (OffloadPromMetrics),
built for our spec on a private registry: the series vLLM's engine exports
for kvoffload, without an engine. Needs vLLM."""

from __future__ import annotations

import functools
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

SPEC = {"spec_name": "KVOffloadingSpec", "spec_module_path": "kvoffload.integrations.vllm"}
ENGINE_LABELS = ["model_name", "engine"]  # what vLLM's stat logger adds to every series


def offload_prom_metrics(extra: dict, registry: CollectorRegistry):
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadPromMetrics

    types = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config={**SPEC, **extra}))
    return OffloadPromMetrics(config, types, list(ENGINE_LABELS), {0: ["tiny", "0"]})


def text(registry: CollectorRegistry) -> str:
    return generate_latest(registry).decode()
