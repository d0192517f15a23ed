"""What a serving phase did to the offload path, from two /metrics scrapes
(before and after): counters as deltas, summed over labels we do not split by.

Names are as a vLLM server exposes them: vLLM's own (external_prefix_cache_*
counts tokens the connector served), vLLM's connector transfer counters
(kv_offload_total_bytes by transfer_type) and kvoffload's per-tier series
(vllm:kvoffload_*{tier=...}).
"""

from __future__ import annotations

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]

EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"  # tokens served by the connector
EXTERNAL_QUERIES = "vllm:external_prefix_cache_queries_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"  # tokens served by vLLM's own cache
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
TRANSFER_BYTES = "vllm:kv_offload_total_bytes_total"
TIER = "vllm:kvoffload_"


def total(samples: Samples, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= set(lab))


def tier_names(samples: Samples) -> list[str]:
    names = {dict(lab).get("tier") for (n, lab) in samples if n.startswith(TIER)}
    return sorted(t for t in names if t)


def delta(before: Samples, after: Samples) -> Samples:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def summary(before: Samples, after: Samples) -> dict:
    """Offload hits and bytes of one phase: tokens served by the connector,
    bytes moved GPU<->CPU, and per tier hits / loaded / stored bytes / errors."""
    d = delta(before, after)
    out = {
        "offload_hit_tokens": total(d, EXTERNAL_HITS),
        "offload_query_tokens": total(d, EXTERNAL_QUERIES),
        "vllm_cache_hit_tokens": total(d, PREFIX_HITS),
        "prompt_tokens_queried": total(d, PREFIX_QUERIES),
        "loaded_bytes": total(d, TRANSFER_BYTES, transfer_type="CPU_to_GPU"),
        "stored_bytes": total(d, TRANSFER_BYTES, transfer_type="GPU_to_CPU"),
        "tiers": {},
    }
    for tier in tier_names(after):
        out["tiers"][tier] = {
            key: total(d, f"{TIER}{key}_total", tier=tier)
            for key in ("hits", "lookups", "loaded_bytes", "stored_bytes", "promoted_blocks", "cascaded_blocks",
                        "errors", "store_failures", "load_failures", "stores_refused", "lookup_timeouts",
                        "failed_stores", "allocation_failures", "reconnects")}
        out["tiers"][tier]["server_up"] = total(after, f"{TIER}server_up", tier=tier) if any(
            n == f"{TIER}server_up" and dict(lab).get("tier") == tier for (n, lab) in after) else None
    return out


def tier_hits_line(s: dict) -> str:
    parts = [f"{t}: {v['hits']:.0f} hits, {v['loaded_bytes'] / 2**20:.0f} MiB read, "
             f"{v['stored_bytes'] / 2**20:.0f} MiB written" for t, v in s["tiers"].items()]
    return "; ".join(parts) or "no kvoffload tiers"
