"""The serving benchmark's report: every configuration's figures as ratios to
`none` (no offloading) measured in the same run, a markdown table, a plot."""

from __future__ import annotations

from pathlib import Path

KEYS = ("p50_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "request_throughput")
# done-when targets on the 2-core machine (issue 39)
TARGETS = {"shared-prefix": {"p50_ttft_ms": ("<=", 0.25), "request_throughput": (">=", 2.0)},
           "no-reuse": {"request_throughput": (">=", 0.97)}}


def ratios(results: dict) -> dict:
    """{config: {phase: {key: value / none's value}}}."""
    ref = results.get("none", {}).get("phases", {})
    out: dict = {}
    for name, r in results.items():
        if name == "none":
            continue
        for phase, p in r.get("phases", {}).items():
            base = p.get("reference") or ref.get(phase)  # the paired no-offload runs, where there are
            if not base:
                continue
            out.setdefault(name, {})[phase] = {k: (p[k] / base[k] if base.get(k) else None) for k in KEYS}
    return out


def _fmt(x, digits=2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _spread(p: dict) -> str:
    reps = p.get("repeat_throughputs") or []
    return f" ({min(reps):.2f}-{max(reps):.2f})" if len(reps) > 1 else ""


def _meets(phase: str, key: str, value) -> str:
    target = TARGETS.get(phase, {}).get(key)
    if target is None or value is None:
        return ""
    op, bound = target
    ok = value <= bound if op == "<=" else value >= bound
    return "" if ok else " (!)"


def table_lines(report: dict) -> list[str]:
    res, rat = report["results"], report["ratios"]
    lines = ["| configuration | dataset | TTFT p50 ms | p90 | p99 | req/s (repeats) | failed | p50 ratio | p90 ratio | "
             "p99 ratio | req/s ratio | connector hit tokens | loaded MiB | tier hits | check mismatches |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for name in report["configs"]:
        r = res.get(name, {})
        if "error" in r and not r.get("phases"):
            lines.append(f"| {name} | FAILED: {r['error'].splitlines()[0][:80]} |" + " |" * 13)
            continue
        for phase, p in r.get("phases", {}).items():
            q = rat.get(name, {}).get(phase, {})
            m = p["metrics"]
            tiers = ", ".join(f"{t} {v['hits']:.0f}" for t, v in m["tiers"].items()) or "-"
            check = r.get("check", {}).get("mismatches") if phase == "shared-prefix" else None
            lines.append(
                f"| {name} | {phase} | {p['p50_ttft_ms']:.0f} | {p['p90_ttft_ms']:.0f} | {p['p99_ttft_ms']:.0f} | "
                f"{p['request_throughput']:.2f}{_spread(p)} | {p['failed']} | "
                f"{_fmt(q.get('p50_ttft_ms'))}{_meets(phase, 'p50_ttft_ms', q.get('p50_ttft_ms'))} | "
                f"{_fmt(q.get('p90_ttft_ms'))} | {_fmt(q.get('p99_ttft_ms'))} | "
                f"{_fmt(q.get('request_throughput'))}{_meets(phase, 'request_throughput', q.get('request_throughput'))}"
                f" | {m['offload_hit_tokens']:.0f} | {m['loaded_bytes'] / 2**20:.0f} | {tiers} | "
                f"{'-' if check is None else check} |")
    return lines


def ceiling_lines(report: dict, phase: str = "shared-prefix") -> list[str]:
    """Each configuration's share of what vllm-all (every prefix in vLLM's own
    cache) gained over none: the part of the attainable gain it delivers."""
    rat = report["ratios"]
    top = rat.get("vllm-all", {}).get(phase)
    if not top or not top.get("p50_ttft_ms") or not top.get("request_throughput"):
        return []
    cut, gain = 1 - top["p50_ttft_ms"], top["request_throughput"] - 1
    lines = [f"ceiling (vllm-all, {phase}): TTFT p50 {top['p50_ttft_ms']:.2f}x, req/s {top['request_throughput']:.2f}x"]
    for name in report["configs"]:
        q = rat.get(name, {}).get(phase)
        if name == "vllm-all" or not q or q.get("p50_ttft_ms") is None or q.get("request_throughput") is None:
            continue
        shares = [f"{(1 - q['p50_ttft_ms']) / cut:.0%} of its TTFT cut" if cut > 0 else "",
                  f"{(q['request_throughput'] - 1) / gain:.0%} of its throughput gain" if gain > 0 else ""]
        lines.append(f"  {name}: " + ", ".join(x for x in shares if x))
    return lines


def print_table(report: dict) -> None:
    print(f"\nmachine: {report['machine']}{'  (--quick)' if report['quick'] else ''}")
    print("\n".join(table_lines(report)))
    print("\n".join([""] + ceiling_lines(report)))
    checks = {n: r["check"] for n, r in report["results"].items() if "check" in r}
    if checks:
        total = sum(c["mismatches"] for n, c in checks.items())
        print(f"\noutput check: {sum(c['prompts'] for c in checks.values())} greedy answers compared, "
              f"{total} mismatches against none")


def write_plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rat = report["ratios"]
    phases = [p for p in ("shared-prefix", "no-reuse", "agentic") if any(p in v for v in rat.values())]
    if not phases:
        return
    fig, axes = plt.subplots(1, len(phases), figsize=(5.5 * len(phases), 4.2), squeeze=False)
    for ax, phase in zip(axes[0], phases):
        names = [n for n in report["configs"] if phase in rat.get(n, {})]
        xs = range(len(names))
        ttft = [rat[n][phase]["p50_ttft_ms"] or 0 for n in names]
        thr = [rat[n][phase]["request_throughput"] or 0 for n in names]
        ax.bar([x - 0.2 for x in xs], ttft, 0.4, label="TTFT p50 / none")
        ax.bar([x + 0.2 for x in xs], thr, 0.4, label="req/s / none")
        ax.axhline(1.0, color="grey", lw=0.8)
        for key, (_, bound) in TARGETS.get(phase, {}).items():
            ax.axhline(bound, color="C0" if key == "p50_ttft_ms" else "C1", ls="--", lw=0.8)
        ax.set_xticks(list(xs), names, rotation=30, ha="right", fontsize=8)
        ax.set_title(phase)
        ax.set_ylabel("ratio to no offloading (same run)")
        ax.legend(fontsize=7)
    fig.suptitle(f"kvoffload in vllm serve, {report['machine']}{' (--quick)' if report['quick'] else ''}",
                 fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
