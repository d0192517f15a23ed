"""Replay the Mooncake conversation trace through the real CPU tier.

For each capacity (a share of the trace's unique blocks) and policy: the
offload prefix hit rate of the replay, beside the offline LRU and Belady
simulators at the same capacity; and the wall time of the full replay
(real byte copies, every load verified) split into manager, worker, idle
and harness time. The reference measured in the same run is the offline
LRU simulator over the same trace (pure dict bookkeeping, no copies):
`replay / sim` says what the real manager, worker and checks cost on top.

    .venv/bin/python benchmarks/bench_replay.py
    .venv/bin/python benchmarks/bench_replay.py --capacities 1% --policies lru --kv-bytes-per-token 256

With --storage SHARE (e.g. 25%): CPU tier plus a storage tier of that share
of the unique blocks, in engine time (the `kvoffload replay` default for
tiered runs: vLLM's order, 8192 tokens a step, llama-8b-h100 rates, storage
at 2 GB/s), against the reference: the offline LRU of one cache
as large as both tiers together (ratio), and the CPU tier alone at the same
engine settings (gain from storage).

    .venv/bin/python benchmarks/bench_replay.py --capacities 1%,5% --policies hubchain,lru --storage 25%
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from kvoffload.replay.cli import parse_capacity
from kvoffload.replay.engine import EngineOptions, replay
from kvoffload.replay.oracle import simulate
from kvoffload.replay.report import summary
from kvoffload.replay.traces import load_trace
from shared_traces import shared_trace_path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TRACE = shared_trace_path()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--capacities", default="1%,5%,10%")
    ap.add_argument("--policies", default="lru,arc")
    ap.add_argument("--kv-bytes-per-token", type=int, default=16)
    ap.add_argument("--json", help="write all figures here")
    ap.add_argument("--plot", help="write a PNG of hit rate vs capacity (each policy, LRU sim, Belady) here")
    ap.add_argument("--storage", metavar="SHARE", help="add a storage tier of this share of the unique blocks")
    args = ap.parse_args()

    trace = load_trace(args.trace)
    if args.storage:
        return tiered(trace, args)
    blocks = [r.block_hashes for r in trace.requests]
    unique = trace.num_unique_blocks()
    print(f"{trace.name}: {len(trace.requests):,} requests, {trace.num_block_refs:,} block refs, "
          f"{unique:,} unique blocks; {args.kv_bytes_per_token} KV B/token "
          f"= {args.kv_bytes_per_token * trace.block_size:,} B per block")
    rows, out = [], []
    for cap_s in args.capacities.split(","):
        cap = parse_capacity(cap_s, unique)
        t0 = time.perf_counter()
        lru = simulate(blocks, cap, "lru")
        sim_s = time.perf_counter() - t0
        opt = simulate(blocks, cap, "belady")
        for policy in args.policies.split(","):
            # the legacy order: the trace README's semantics, comparable to the offline LRU
            opts = EngineOptions(extra_config={"num_cpu_chunks": cap, "eviction_policy": policy},
                                 kv_bytes_per_token=args.kv_bytes_per_token, order="legacy")
            r = replay(trace, opts)
            s = summary(r)
            rows.append(
                f"| {cap_s} | {cap:,} | {policy} | {s['offload_prefix_hit_rate']:.4f} | {lru.hit_rate:.4f} | "
                f"{opt.hit_rate:.4f} | {s['wall_s']:.1f} | {s['manager_s']:.1f} | {s['worker_s']:.1f} | "
                f"{s['harness_s']:.1f} ({100 * s['harness_share']:.0f}%) | {s['verified_blocks']:,} | "
                f"{s['wall_s'] / sim_s:.0f}x |")
            out.append({"capacity": cap_s, "blocks": cap, "policy": policy, "summary": s,
                        "sim_lru": lru.hit_rate, "belady": opt.hit_rate, "sim_lru_s": sim_s})
            print(rows[-1], flush=True)
    print()
    print("| capacity | blocks | policy | replay hit rate | LRU sim | Belady | wall s | manager s | worker s "
          "| harness s | verified loads | replay / sim |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    print("\n".join(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=str) + "\n")
    if args.plot:
        plot(out, args.plot, trace.name)


def tiered(trace, args) -> None:
    """CPU + storage in engine time against one LRU cache of the same total size."""
    import tempfile

    blocks = [r.block_hashes for r in trace.requests]
    unique = trace.num_unique_blocks()
    slots = parse_capacity(args.storage, unique, "--storage")
    page = args.kv_bytes_per_token * trace.block_size
    print(f"{trace.name}: {unique:,} unique blocks; storage {args.storage} = {slots:,} blocks; engine time")
    rows, out = [], []
    for cap_s in args.capacities.split(","):
        cap = parse_capacity(cap_s, unique)
        oracle = simulate(blocks, cap + slots, "lru").hit_rate
        for policy in args.policies.split(","):
            common = dict(kv_bytes_per_token=args.kv_bytes_per_token, time_model="engine", max_batched_tokens=8192,
                          progress=False)
            with tempfile.TemporaryDirectory() as d:
                extra = {"num_cpu_chunks": cap, "eviction_policy": policy, "storage_dir": d,
                         "storage_bytes": slots * (-(-page // 4096) * 4096)}
                s = summary(replay(trace, EngineOptions(spec="tiered", extra_config=extra, **common)))
            alone = summary(replay(trace, EngineOptions(extra_config={"num_cpu_chunks": cap,
                                                                      "eviction_policy": policy}, **common)))
            hr, cpu = s["offload_prefix_hit_rate"], alone["offload_prefix_hit_rate"]
            st = s["tiers"]["storage"]["counters"]
            rows.append(f"| {cap_s} | {args.storage} | {policy} | {hr:.4f} | {oracle:.4f} | {hr / oracle:.3f} | "
                        f"{cpu:.4f} | {hr - cpu:+.4f} | {int(st.get('cascaded_blocks', 0)):,} | "
                        f"{int(st.get('promoted_blocks', 0)):,} | {s['tier_wait_s']:,.0f} | {s['wall_s']:.0f} |")
            out.append({"capacity": cap_s, "storage": args.storage, "policy": policy, "summary": s,
                        "oracle_lru_all_tiers": oracle, "cpu_alone": cpu})
            print(rows[-1], flush=True)
    print()
    print("| CPU | storage | policy | hit rate | LRU, same total | ratio | CPU alone | gain | cascaded | promoted "
          "| engine waits s (simulated) | wall s |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    print("\n".join(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=str) + "\n")


def plot(points: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy in dict.fromkeys(p["policy"] for p in points):
        mine = [p for p in points if p["policy"] == policy]
        ax.plot([p["blocks"] for p in mine], [p["summary"]["offload_prefix_hit_rate"] for p in mine], "o-",
                label=f"replay, {policy}")
    first = [p for p in points if p["policy"] == points[0]["policy"]]
    caps = [p["blocks"] for p in first]
    ax.plot(caps, [p["sim_lru"] for p in first], "k:", label="LRU (offline sim)")
    ax.plot(caps, [p["belady"] for p in first], "^--", label="Belady (optimal)")
    ax.set_xscale("log")
    ax.set_xlabel("CPU tier capacity (blocks of 512 tokens)")
    ax.set_ylabel("prefix hit rate")
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
