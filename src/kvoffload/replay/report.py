"""What a replay found: a terminal table, JSON, Markdown and PNG plots."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvoffload.policies import DEFAULT_POLICY
from kvoffload.redact import redact
from kvoffload.replay.engine import ReplayResult
from kvoffload.replay.report_time import cpu_blocks_needed, cpu_size_warning, time_rows  # noqa: F401 (the CLI's too)
from kvoffload.stats import lookup_hit_rate


def _rate(n: float, d: float) -> float:
    return n / d if d else 0.0


def summary(r: ReplayResult) -> dict[str, Any]:
    """The headline numbers, derived from the raw counters."""
    c = r.counters
    o = r.options
    refs = c["block_refs"]
    prefill = o["prefill_tokens_per_s"]
    load_s = c["load_time_s"]
    s: dict[str, Any] = {
        "requests": int(c["requests"]),
        "prompt_tokens": int(c["prompt_tokens"]),
        "block_refs": int(refs),
        "tokens_from_gpu_cache": int(c["gpu_hit_tokens"]),
        "tokens_from_offload": int(c["offload_hit_tokens"]),
        "tokens_recomputed": int(c["recomputed_tokens"]),
        "gpu_prefix_hit_rate": _rate(c["gpu_hit_blocks"], refs),
        "offload_prefix_hit_rate": _rate(c["offload_hit_blocks"], refs),
        "bytes_stored": int(c["bytes_stored"]),
        "bytes_loaded": int(c["bytes_loaded"]),
        "store_GBps": _rate(c["bytes_stored"], c["store_time_s"]) / 1e9,
        "load_GBps": _rate(c["bytes_loaded"], load_s) / 1e9,
        "manager_ns_per_block_p50": r.manager_ns_per_block["p50"],
        "manager_ns_per_block_p99": r.manager_ns_per_block["p99"],
        "evictions": int(c["evicted_blocks"]),
        "gpu_evictions": int(c["gpu_evictions"]),
        "allocation_failures": int(c["allocation_failures"]),
        "delayed_lookups": int(c["delayed_lookups"]),
        "delay_timeouts": int(c["delay_timeouts"]),
        "load_failures": int(c["load_failures"]),
        "store_failures": int(c["store_failures"]),
        "verified_blocks": int(c["verified_blocks"]),
        "verify_failures": int(c["verify_failures"]),
        "preemptions": int(c.get("preemptions", 0)),
        "aborts": int(c.get("aborts", 0)),
        "resets": int(c.get("resets", 0)),
        "stale_completions": int(c.get("stale_completions", 0)),
        # Prefill the offload tiers spared, minus the time the loads took.
        "prefill_saved_s": c["offload_hit_tokens"] / prefill - load_s,
        "prefill_saved_by_gpu_cache_s": c["gpu_hit_tokens"] / prefill,
        "wall_s": r.wall_s,
        "manager_s": r.manager_s,
        "manager_calls_s": r.manager_calls_s,
        "worker_s": r.worker_s,
        "idle_s": r.idle_s,
        "cpu_s": r.cpu_s,
        "content_s": r.content_s,
        "harness_s": r.harness_s,
        "harness_share": _rate(r.harness_s, r.wall_s),
    }
    s["time_model"] = o.get("time_model", "fast")
    s["compute_s"] = c.get("compute_s", 0.0)
    s["tier_wait_s"] = c.get("tier_wait_s", 0.0)
    s["cpu_blocks_needed"] = cpu_blocks_needed(r)
    s["tiers"] = tier_rows(r)
    for k, v in r.oracle.items():
        if k != "per_tier":  # shown per tier
            s[f"oracle:{k}"] = v
    return s


def tier_rows(r: ReplayResult) -> dict[str, dict[str, Any]]:
    """Per offload tier: its stats, and the share of prompt blocks it served
    (its prefix hit rate: blocks it supplied / prompt block references).

    Every load reaches the GPU from the CPU tier; a block a lower tier held is
    first promoted into CPU, often by look-ahead (the rest of a prefix after
    one lower-tier hit), so a hit is credited to where the block was when the
    request arrived: a block the CPU tier lacked then, and the engine did not
    store since, was promoted (counter offload_hit_blocks_promoted). Promoted
    blocks are split between several lower tiers by what each promoted.

    Also each tier's lookup hit rate: hits / lookups of that tier's manager,
    one lookup per block up to a request's first miss, so it is higher than
    the prefix hit rate (the figure `kvoffload stats` shows)."""
    c = r.counters
    refs = c["block_refs"]
    leaves = {n: t for n, t in r.tiers.items() if not t.get("composite")}
    names = list(leaves)
    promoted = c.get("offload_hit_blocks_promoted", 0)
    lower = sum(leaves[n]["counters"].get("promoted_blocks", 0) for n in names[1:])
    out = {}
    per_tier = r.oracle.get("per_tier") or {}
    served_above = 0.0  # blocks the tiers above this one served
    for name, t in leaves.items():
        tc = t["counters"]
        if len(leaves) == 1:
            served = c["offload_hit_blocks"]
        elif name == names[0]:
            served = c["offload_hit_blocks"] - promoted
        else:
            served = promoted * _rate(tc.get("promoted_blocks", 0), lower)
        out[name] = {
            "medium": t.get("medium"),
            "locality": t.get("locality"),
            "prefix_hit_rate": _rate(served, refs),
            "served_blocks": served,
            "lookup_hit_rate": lookup_hit_rate(tc),
            "capacity_blocks": t["gauges"].get("capacity_blocks"),
            "blocks_at_start": t.get("blocks_at_start", 0),
            **{k: tc[k] for k in ("lookups", "hits", "hits_pending", "stored_blocks", "loaded_blocks",
                                  "promoted_blocks", "evictions", "allocation_failures", "dropped_stores",
                                  "checksum_failures") if k in tc},
            "counters": dict(tc),  # every counter the tier's stats carry
            "gauges": dict(t["gauges"]),
            "engine_time": t.get("engine_time"),
        }
        served_above += served
        if name in per_tier:  # how far from the best any policy could do with these tiers
            opt = per_tier[name]
            out[name]["belady_capacity_blocks"] = opt["capacity_blocks"]
            out[name]["belady_prefix_hit_rate"] = opt["belady"]
            out[name]["belady_headroom"] = opt["belady"] - _rate(served_above, refs)
    return out


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        return f"{v:.4f}" if abs(v) < 10 else f"{v:.2f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def _rows(r: ReplayResult) -> list[tuple[str, str]]:
    s = summary(r)
    o = r.options
    policy = o["extra_config"].get("eviction_policy", DEFAULT_POLICY)
    rows = [
        ("trace", r.trace),
        ("spec / policy", f"{o['spec']} / {policy}"),
        ("engine", f"GPU cache {o['gpu_blocks']:,} blocks, {o['max_running']} running, "
                   f"{o['block_size']}-token blocks of {o['page_bytes']:,} B, arrival {o['arrival']}"
                   + (f" /{o['time_compression']:g}" if o["arrival"] == "trace" else "")
                   + f", {o.get('order', 'legacy')} call order"),
        ("requests", _fmt(s["requests"])),
        ("prompt tokens", _fmt(s["prompt_tokens"])),
        ("  from GPU cache", f"{s['tokens_from_gpu_cache']:,}"),
        ("  from offload tiers", f"{s['tokens_from_offload']:,}"),
        ("  recomputed", f"{s['tokens_recomputed']:,}"),
        ("prefix hit rate: GPU cache", f"{s['gpu_prefix_hit_rate']:.4f}"),
        ("prefix hit rate: offload", f"{s['offload_prefix_hit_rate']:.4f}"),
    ]
    for name, tier in s["tiers"].items():
        where = ", ".join(str(x) for x in (tier["medium"], tier["locality"]) if x)
        cap = tier["capacity_blocks"]
        rows.append((f"  tier {name} ({where})",
                     f"prefix hit rate {tier['prefix_hit_rate']:.4f} (lookup hit rate "
                     f"{tier['lookup_hit_rate']:.4f}), capacity "
                     f"{_fmt(int(cap)) + ' blocks' if cap else 'n/a'}, stored {_fmt(tier.get('stored_blocks', 0))}, "
                     f"evictions {_fmt(tier.get('evictions', 0))}"))
        if tier["blocks_at_start"]:
            rows.append(("    at the start", f"{_fmt(tier['blocks_at_start'])} blocks already held (an earlier "
                                            "run's: this replay started warm)"))
        if "belady_headroom" in tier:
            scope = f"tier {name}" if len(s["tiers"]) == 1 else f"tiers down to {name} together"
            rows.append((f"    vs Belady at {_fmt(int(tier['belady_capacity_blocks']))} blocks",
                         f"{tier['belady_prefix_hit_rate']:.4f}: headroom {tier['belady_headroom']:.4f} "
                         f"({policy} on {scope}: "
                         f"{tier['belady_prefix_hit_rate'] - tier['belady_headroom']:.4f})"))
        if tier["counters"]:
            rows.append(("    counters", ", ".join(f"{k} {_fmt(v)}" for k, v in sorted(tier["counters"].items()))))
        if tier["gauges"]:
            rows.append(("    gauges at the end", ", ".join(f"{k} {_fmt(v)}" for k, v in sorted(tier["gauges"].items()))))
        if tier.get("engine_time"):
            et = tier["engine_time"]
            rows.append(("    modeled bandwidth", f"{et['bandwidth_Bps'] / 1e9:.2f} GB/s: busy {et['busy_s']:.1f} s "
                         f"({100 * et['busy_share']:.0f}% of the run), peak backlog {et['peak_backlog_s']:.2f} s; "
                         f"{et['late_waits']:,} waits on this machine ({et['late_wait_s']:.1f} s wall)"))
    for name, t in r.tiers.items():  # a composing manager's own counters (its leaves' are above)
        if t.get("composite") and t["counters"]:
            rows.append((f"  manager {name}", ", ".join(f"{k} {_fmt(v)}" for k, v in sorted(t["counters"].items()))))
    rows += time_rows(r, s)
    if not r.oracle and s["tiers"]:
        rows.append(("  vs Belady", "add --oracle to see each tier's distance from the optimum"))
    if r.oracle:
        o_ = r.oracle
        scope = "CPU tier alone, " if "all_tiers_capacity_blocks" in o_ else ""
        rows.append((f"oracle at {scope}{_fmt(o_.get('capacity_blocks'))} blocks",
                     f"LRU {o_['lru']:.4f}, Belady {o_['belady']:.4f} "
                     f"({policy}: {s['offload_prefix_hit_rate']:.4f})"))
        if "all_tiers_capacity_blocks" in o_:
            rows.append((f"oracle at all tiers' capacity, {_fmt(o_['all_tiers_capacity_blocks'])} blocks",
                         f"LRU {o_['all_tiers_lru']:.4f}, Belady {o_['all_tiers_belady']:.4f} "
                         f"(one cache as large as the tiers together)"))
    rows += [
        ("bytes stored / loaded", f"{s['bytes_stored'] / 1e6:,.1f} MB / {s['bytes_loaded'] / 1e6:,.1f} MB"),
        ("transfer GB/s store / load", f"{s['store_GBps']:.2f} / {s['load_GBps']:.2f}"),
        ("manager ns/block p50 / p99",
         f"{s['manager_ns_per_block_p50']:,.0f} / {s['manager_ns_per_block_p99']:,.0f}"),
        ("evictions offload / GPU", f"{s['evictions']:,} / {s['gpu_evictions']:,}"),
        ("allocation failures", f"{s['allocation_failures']:,}"),
        ("delayed lookups (timed out)", f"{s['delayed_lookups']:,} ({s['delay_timeouts']:,})"),
        ("load / store failures", f"{s['load_failures']:,} / {s['store_failures']:,}"),
        ("preemptions / aborts / resets", f"{s['preemptions']:,} / {s['aborts']:,} / {s['resets']:,} "
                                          f"({s['stale_completions']:,} completions dropped by resets)"),
        ("verified loaded blocks", f"{s['verified_blocks']:,} ({s['verify_failures']:,} MISMATCHED)"
         if s["verify_failures"] else f"{s['verified_blocks']:,} ({_checked(r)})"),
        (f"prefill saved @ {o['prefill_tokens_per_s']:,.0f} tok/s",
         f"{s['prefill_saved_s']:.1f} s by offload, {s['prefill_saved_by_gpu_cache_s']:.1f} s by GPU cache"),
        ("wall time", f"{s['wall_s']:.2f} s: manager {s['manager_s']:.2f}, worker {s['worker_s']:.2f}"
                      f"{' (copies inline)' if o.get('copies_inline') else ''}, "
                      f"idle {s['idle_s']:.2f}, harness {s['harness_s']:.2f} = {100 * s['harness_share']:.0f}% "
                      f"(block contents {s['content_s']:.2f}); CPU time {s['cpu_s']:.2f} s"),
    ]
    return rows


def format_table(r: ReplayResult) -> str:
    rows = _rows(r)
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def to_markdown(r: ReplayResult) -> str:
    lines = ["| metric | value |", "|---|---|"]
    lines += [f"| {k.strip()} | {v} |" for k, v in _rows(r)]
    return "\n".join(lines) + "\n"


def to_json(r: ReplayResult) -> dict[str, Any]:
    # options carry the tiers' config (e.g. remote_url with its password): mask secrets
    return redact({"summary": summary(r), "result": asdict(r)})


def write_json(obj: Any, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, default=str) + "\n")


# ---- sweeps ---------------------------------------------------------------


def sweep_table(points: list[tuple[int, ReplayResult]]) -> str:
    has_oracle = any(r.oracle for _, r in points)
    head = "| CPU capacity (blocks) | offload prefix hit rate | GPU hit rate |"
    sep = "|---:|---:|---:|"
    if has_oracle:
        head += " LRU sim | Belady |"
        sep += "---:|---:|"
    lines = [head, sep]
    for cap, r in points:
        s = summary(r)
        line = f"| {cap:,} | {s['offload_prefix_hit_rate']:.4f} | {s['gpu_prefix_hit_rate']:.4f} |"
        if has_oracle:
            line += f" {r.oracle.get('lru', float('nan')):.4f} | {r.oracle.get('belady', float('nan')):.4f} |"
        lines.append(line)
    return "\n".join(lines) + "\n"


def policy_table(by_policy: dict[str, list[tuple[Any, ReplayResult]]]) -> str:
    """Policies side by side (`--policy a,b,c`): one row per capacity, each
    policy's offload prefix hit rate, the best named with its gain over the
    first policy listed, and the oracles (from the first policy's replays)
    when they were simulated; then each one's manager time per block
    reference, against the first's."""
    names = list(by_policy)
    rows = list(zip(*by_policy.values()))  # per capacity: (capacity, result) of each policy
    first = by_policy[names[0]]
    has_oracle = any(r.oracle for _, r in first)
    head = "| CPU capacity (blocks) | " + " | ".join(names) + f" | best (vs {names[0]}) |"
    sep = "|---:|" + "---:|" * len(names) + "---|"
    if has_oracle:
        head += " LRU sim | Belady |"
        sep += "---:|---:|"
    lines = [head, sep]
    for row in rows:
        cap, base = row[0][0], row[0][1]
        rates = [summary(r)["offload_prefix_hit_rate"] for _, r in row]
        best = max(range(len(rates)), key=rates.__getitem__)  # a tie: the first listed
        cells = [f"**{x:.4f}**" if i == best else f"{x:.4f}" for i, x in enumerate(rates)]
        line = f"| {_cap(cap)} | " + " | ".join(cells) + f" | {names[best]} {rates[best] - rates[0]:+.4f} |"
        if has_oracle:
            line += f" {base.oracle.get('lru', float('nan')):.4f} | {base.oracle.get('belady', float('nan')):.4f} |"
        lines.append(line)
    # What each costs: the managers' time per block reference in this run (replays running side by side
    # share the machine: a rough guide; benchmarks/bench_manager.py measures it properly)
    lines += ["", "| manager µs per block | " + " | ".join(names) + " |", "|---:|" + "---:|" * len(names)]
    for row in rows:
        cap = row[0][0]
        cost = [1e6 * r.manager_s / r.counters["block_refs"] if r.counters["block_refs"] else 0.0 for _, r in row]
        cells = [f"{cost[0]:.2f}"] + [f"{c:.2f} ({c / cost[0]:.2f}x)" if cost[0] else f"{c:.2f}" for c in cost[1:]]
        lines.append(f"| {_cap(cap)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _cap(cap: Any) -> str:
    """A capacity cell: blocks with thousands separators, else as given."""
    return f"{cap:,}" if isinstance(cap, int) else str(cap)


def plot_policies(by_policy: dict[str, list[tuple[Any, ReplayResult]]], path: str | Path, title: str = "") -> None:
    """Each policy's offload prefix hit rate against the CPU capacity, with
    Belady's where it was simulated."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    first = next(iter(by_policy.values()))
    caps = list(range(len(first)))  # evenly spaced, labelled with the capacities
    ticks = [_cap(cap) for cap, _ in first]
    for name, points in by_policy.items():
        ax.plot(caps, [summary(r)["offload_prefix_hit_rate"] for _, r in points], "o-", label=name)
    if all(r.oracle for _, r in first):
        ax.plot(caps, [r.oracle["belady"] for _, r in first], "^--", color="gray", label="Belady (optimal)")
    ax.set_xticks(caps, ticks)
    ax.set_xlabel("CPU tier capacity (blocks)")
    ax.set_ylabel("offload prefix hit rate")
    ax.set_title(title or "hit rate by policy")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_timeline(r: ReplayResult, path: str | Path) -> None:
    """Prefix hit rate per window of requests: GPU cache, offload tiers, and
    with lower tiers, what the CPU tier served directly vs what was promoted."""
    plt = _plt()
    t = r.timeline
    if len(t) < 2:
        return
    multi = sum(not x.get("composite") for x in r.tiers.values()) > 1
    series: dict[str, list[float]] = {"GPU cache": [], "offload (all tiers)": []}
    if multi:
        series["CPU tier (direct)"] = []
        series["lower tiers (promoted)"] = []
    xs = []
    for a, b in zip(t, t[1:]):
        refs = b["block_refs"] - a["block_refs"]
        if refs <= 0:
            continue
        xs.append(b["requests"])
        d = {k: b[k] - a[k] for k in ("gpu_hit_blocks", "offload_hit_blocks", "offload_hit_blocks_promoted")}
        series["GPU cache"].append(d["gpu_hit_blocks"] / refs)
        series["offload (all tiers)"].append(d["offload_hit_blocks"] / refs)
        if multi:
            series["CPU tier (direct)"].append((d["offload_hit_blocks"] - d["offload_hit_blocks_promoted"]) / refs)
            series["lower tiers (promoted)"].append(d["offload_hit_blocks_promoted"] / refs)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, ys in series.items():
        ax.plot(xs, ys, label=label)
    ax.set_xlabel("requests replayed")
    ax.set_ylabel("prefix hit rate (per window)")
    ax.set_title(f"{r.trace}: hit rate over time")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(points: list[tuple[int, ReplayResult]], path: str | Path, title: str = "") -> None:
    plt = _plt()
    caps = [cap for cap, _ in points]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    policy = points[0][1].options["extra_config"].get("eviction_policy", DEFAULT_POLICY) if points else DEFAULT_POLICY
    ax.plot(caps, [summary(r)["offload_prefix_hit_rate"] for _, r in points], "o-", label=f"replay ({policy})")
    if all(r.oracle for _, r in points):
        ax.plot(caps, [r.oracle["lru"] for _, r in points], "s--", label="LRU (offline sim)")
        ax.plot(caps, [r.oracle["belady"] for _, r in points], "^--", label="Belady (optimal)")
    ax.set_xscale("log")
    ax.set_xlabel("CPU tier capacity (blocks)")
    ax.set_ylabel("offload prefix hit rate")
    ax.set_title(title or "hit rate vs CPU capacity")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _checked(r: ReplayResult) -> str:
    """What the load checks compared (engine option verify)."""
    from kvoffload.replay.contents import SAMPLE_WORDS

    if r.options.get("verify", "all") == "all" or r.options["page_bytes"] // 8 <= SAMPLE_WORDS:
        return "all bytes match"

    return f"sampled bytes match: {SAMPLE_WORDS} words of each block; --verify all checks every byte"
