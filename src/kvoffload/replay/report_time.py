"""The report's lines on time and size: the engine-time model's split of
the simulated time, and the CPU tier a trace's long prompts need."""

from __future__ import annotations

from typing import Any

from kvoffload.replay.engine import ReplayResult


def _rate(n: float, d: float) -> float:
    return n / d if d else 0.0


def cpu_blocks_needed(r: ReplayResult) -> int:
    """The CPU tier a tiered replay of this trace needs: promotions from the
    tiers below may hold at most half of CPU, so a prompt of N blocks can
    get all of them back only from a CPU tier of 2N blocks."""
    return 2 * int(r.counters.get("longest_prompt_blocks", 0))


def cpu_size_warning(r: ReplayResult) -> str | None:
    """A line when the CPU tier is too small for the longest prompt's
    promotions (tiers below CPU only), else None."""
    leaves = [t for t in r.tiers.values() if not t.get("composite")]
    cap = leaves[0]["gauges"].get("capacity_blocks") if leaves else None
    need = cpu_blocks_needed(r)
    if len(leaves) < 2 or not cap or cap >= need:
        return None
    beyond = r.counters.get("blocks_beyond_half_cpu", 0)
    refs = r.counters["block_refs"]
    return (f"the CPU tier ({int(cap):,} blocks) is smaller than this trace needs ({need:,}: twice its longest "
            f"prompt, {need // 2:,} blocks; promotions from the tiers below hold at most half of CPU), so "
            f"long prompts get at most {int(cap) // 2:,} blocks back from below: {_rate(beyond, refs):.1%} of "
            f"the prompt blocks are out of their reach")


def time_rows(r: ReplayResult, s: dict[str, Any]) -> list[tuple[str, str]]:
    o = r.options
    warn = cpu_size_warning(r)
    rows = [("WARNING", warn)] if warn else []
    if s["time_model"] != "engine":
        return rows + [("time model", "fast: no clock (the tiers below CPU run at this machine's speed; "
                                      "--time-model engine paces them)" if len(s["tiers"]) > 1 else "fast")]
    return rows + [("time model", f"engine: {r.counters['sim_time_ms'] / 1000:,.1f} s simulated = compute "
                           f"{s['compute_s']:,.1f} s ({o['prefill_tokens_per_s']:,.0f} prefill, "
                           f"{o['decode_tokens_per_s']:,.0f} decode tok/s; {o['model_kv_bytes_per_token']:,} "
                           f"KV B/token moved) + waiting on tiers {s['tier_wait_s']:,.1f} s")]
