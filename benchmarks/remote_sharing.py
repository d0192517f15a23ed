"""Part 2 of bench_remote.py: the shared trace split round-robin across two
simulated engines (kvoffload's replay engine, two threads at once) over one
remote tier, isolated (a key prefix each) or sharing one prefix; the gain is
the cross-instance hits, against infinite-cache ceilings."""

from __future__ import annotations

import threading
import time
from pathlib import Path


def two_engines(url: str, trace_path: Path, requests: int, cpu_share: float, shared: bool,
                tier_conf: dict | None = None, kind: str = "redis") -> dict:
    """kind "mooncake": url is ignored, tier_conf says where the store is."""
    from kvoffload.replay.engine import EngineOptions, ReplayEngine
    from kvoffload.replay.traces import Trace, load_trace

    trace = load_trace(trace_path, limit=requests)
    halves = [Trace(f"{trace.name}[{i}::2]", trace.block_size, trace.requests[i::2]) for i in (0, 1)]
    cpu_blocks = max(16, int(cpu_share * trace.num_unique_blocks()))
    run_id = time.monotonic_ns()
    engines, results, errors = [], [None, None], []
    for i, half in enumerate(halves):
        prefix = f"share{run_id}" if shared else f"iso{run_id}-{i}"
        opts = EngineOptions(spec="tiered", progress=False, extra_config={
            "num_cpu_chunks": cpu_blocks,
            # a deep queue: measure sharing, not the tiering manager's back-pressure on a loaded machine
            "secondary_tiers": [{"type": kind, **({"url": url} if kind == "redis" else {}), "key_prefix": prefix,
                                 "max_queue_depth": 1 << 16, **(tier_conf or {})}]})
        engines.append(ReplayEngine(half, opts))

    def run(i):
        try:
            results[i] = engines[i].run()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    for e in engines:
        e.close()
    if errors:
        raise errors[0]
    out = {"wall_s": wall, "cpu_blocks": cpu_blocks, "engines": []}
    for res in results:
        c = res.counters
        remote = res.tiers.get(kind, {}).get("counters", {})
        cpu = res.tiers.get("cpu", {}).get("counters", {})
        out["engines"].append({
            "block_refs": c["block_refs"], "offload_hits": c["offload_hit_blocks"],
            "remote_hits": remote.get("promoted_blocks", 0), "cpu_hits": cpu.get("hits", 0),
            "verified": c["verified_blocks"], "verify_failures": c["verify_failures"],
            "remote_stored": remote.get("stored_blocks", 0), "remote_dropped": remote.get("dropped_stores", 0),
            "delay_timeouts": c["delay_timeouts"]})
    return out


def infinite_cache_rates(trace_path: Path, requests: int) -> tuple[float, float]:
    """Prefix hit rate with an infinite cache per engine (isolated) and one
    shared by both: the ceilings the two runs aim at."""
    from kvoffload.replay.traces import load_trace

    reqs = [r.block_hashes for r in load_trace(trace_path, limit=requests).requests]

    def hits(rs):
        seen, n = set(), 0
        for h in rs:
            for b in h:
                if b not in seen:
                    break
                n += 1
            seen.update(h)
        return n

    refs = sum(len(h) for h in reqs)
    return (hits(reqs[0::2]) + hits(reqs[1::2])) / refs, hits(reqs) / refs


def print_sharing(iso: dict, sh: dict, requests: int, ceilings: tuple[float, float], kind: str = "redis") -> None:
    print(f"\nTwo engines, {requests} requests of the Mooncake trace split round-robin, "
          f"CPU tier {iso['cpu_blocks']} blocks each, one remote tier ({kind})")
    print("| run | engine | block refs | offload prefix hits | promoted from remote | hit rate | verified "
          "| stored to / dropped by remote |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in (("isolated (prefix each)", iso), ("shared (one prefix)", sh)):
        for i, e in enumerate(r["engines"]):
            print(f"| {name} | {i} | {e['block_refs']:,} | {e['offload_hits']:,} | {e['remote_hits']:,} | "
                  f"{e['offload_hits'] / max(1, e['block_refs']):.4f} | {e['verified']:,} "
                  f"({e['verify_failures']} bad) | {e['remote_stored']:,} / {e['remote_dropped']:,} |")
    hits_iso = sum(e["offload_hits"] for e in iso["engines"])
    hits_sh = sum(e["offload_hits"] for e in sh["engines"])
    refs = sum(e["block_refs"] for e in sh["engines"])
    print(f"cross-instance hits (shared - isolated prefix hits): {hits_sh - hits_iso:,} blocks; "
          f"fleet prefix hit rate {hits_iso / refs:.4f} isolated -> {hits_sh / refs:.4f} shared "
          f"(x{hits_sh / max(1, hits_iso):.2f}); infinite-cache ceilings {ceilings[0]:.4f} isolated, "
          f"{ceilings[1]:.4f} shared")
