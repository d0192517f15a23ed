"""Eviction policies: prefix hit rate versus capacity, and per-block cost.

Replays a trace through each EvictionPolicy the way a prefix cache uses it
(the trace README's semantics): at arrival a request looks up all its
blocks and gains the leading run of resident ones; then its resident blocks
are touched (pinned while loading, so not evictable), room is made for the
missing ones with `evict`, and they are inserted in prefix order. On the
generated chat workload the blocks completed during decode are stored after
the prompt, in a second insert of the same request. OPT is Belady's offline
optimum on the same semantics.

Per-block cost: seconds spent inside the policy calls divided by block
operations (touched + inserted keys), as a ratio to LRU in the same run.

    .venv/bin/python benchmarks/bench_policies.py               # Mooncake sweep + chat workload
    .venv/bin/python benchmarks/bench_policies.py --fractions 0.05 --no-chat
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tqdm import tqdm

from kvoffload.abstractions import ReqContext
from kvoffload.policies import get_policy_class
from kvoffload.replay.oracle import simulate_belady

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TRACE = ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
POLICIES = ("lru", "arc", "s3fifo", "sieve", "hubchain")
FRACTIONS = (0.01, 0.02, 0.05, 0.10, 0.25, 0.50)
MANAGER_REPEATS = 3

# A request: (req_id, prompt keys in prefix order, decode keys stored after).
Request = tuple[str, list[bytes], list[bytes]]


def _key(h: int) -> bytes:
    return (h & (2**64 - 1)).to_bytes(8, "big") + b"\0\0\0\0"  # group 0


def load_mooncake(path: Path) -> list[Request]:
    with open(path) as f:
        return [(str(i), [_key(h) for h in json.loads(line)["hash_ids"]], [])
                for i, line in enumerate(f) if line.strip()]


def load_chat(seed: int, sessions: int) -> list[Request]:
    from kvoffload.replay.generator import generate_chat

    trace = generate_chat(seed=seed, sessions=sessions)
    return [(r.req_id, [_key(h) for h in r.block_hashes], [_key(h) for h in (r.decode_hashes or [])])
            for r in trace.requests]


def unique_blocks(reqs: list[Request]) -> int:
    return len({k for _, p, d in reqs for k in p + d})


def replay(reqs: list[Request], policy: str, capacity: int) -> tuple[float, float, int]:
    """Returns (prefix hit rate, seconds inside the policy, block operations)."""
    pol = get_policy_class(policy)(capacity)
    clock = time.perf_counter
    hits = refs = ops = 0
    spent = 0.0
    for req_id, prompt, decode in reqs:
        refs += len(prompt)
        for k in prompt:
            if k not in pol:
                break
            hits += 1
        ctx = ReqContext(req_id)
        for keys in (prompt, decode):
            if not keys:
                continue
            held = [k for k in keys if k in pol]
            new = [k for k in keys if k not in pol]
            if len(new) > capacity:
                new = []  # cannot fit: the store is refused
            pinned = set(held)
            t0 = clock()
            if held:
                pol.touch(held, ctx)
            need = len(pol) + len(new) - capacity
            if need > 0 and pol.evict(need, lambda k: k not in pinned) is None:
                raise AssertionError(f"{policy}: could not evict {need} at capacity {capacity}")
            if new:
                pol.insert(new, ctx)
            spent += clock() - t0
            ops += len(held) + len(new)
            assert len(pol) <= capacity
    return hits / refs, spent, ops


def manager_cost(reqs: list[Request], policy: str, capacity: int) -> tuple[float, float]:
    """The same replay through a CPUOffloadingManager (lookups, pins, slot
    bookkeeping and the policy): (prefix hit rate, seconds per block op)."""
    from kvoffload.tiers.cpu.manager import CPUOffloadingManager

    m = CPUOffloadingManager(capacity, policy)
    hits = refs = ops = 0
    t0 = time.perf_counter()
    for req_id, prompt, decode in reqs:
        ctx = ReqContext(req_id)
        refs += len(prompt)
        n = 0
        for k in prompt:
            if m.lookup(k, ctx).name != "HIT":
                break
            n += 1
        hits += n
        if n:
            m.prepare_load(prompt[:n], ctx)
        m.touch(prompt, ctx)
        for keys in (prompt, decode):
            if keys and len(keys) <= capacity:
                out = m.prepare_store(keys, ctx)
                if out is not None and out.keys_to_store:
                    m.complete_store(out.keys_to_store, ctx)
            ops += len(keys)
        if n:
            m.complete_load(prompt[:n], ctx)
    return hits / refs, (time.perf_counter() - t0) / max(ops, 1)


def opt(reqs: list[Request], capacity: int) -> float:
    """Belady (replay/oracle.py): the best any policy can do."""
    return simulate_belady([p for _, p, _ in reqs], capacity, [d for _, _, d in reqs]).hit_rate


def sweep(name: str, reqs: list[Request], fractions, policies) -> dict:
    uniq = unique_blocks(reqs)
    caps = [max(1, round(f * uniq)) for f in fractions]
    rates: dict[str, list[float]] = {p: [] for p in (*policies, "opt")}
    cost: dict[str, list[float]] = {p: [] for p in policies}
    jobs = [(p, c) for c in caps for p in (*policies, "opt")]
    for p, c in tqdm(jobs, desc=name, unit="run", file=sys.stderr):
        if p == "opt":
            rates[p].append(opt(reqs, c))
        else:
            rate, spent, ops = replay(reqs, p, c)
            rates[p].append(rate)
            cost[p].append(spent / max(ops, 1))
    mid = caps[len(caps) // 2]
    mcost = {}
    for p in tqdm([p for _ in range(MANAGER_REPEATS) for p in policies], desc=f"{name} manager cost",
                  unit="run", file=sys.stderr):
        mcost[p] = min(mcost.get(p, 1.0), manager_cost(reqs, p, mid)[1])  # best of: the machine is noisy
    return {"name": name, "unique": uniq, "fractions": list(fractions), "capacities": caps,
            "rates": rates, "cost_s_per_block": cost, "manager_capacity": mid,
            "manager_s_per_block": mcost}


def report(res: dict) -> None:
    fr, caps, rates, cost = res["fractions"], res["capacities"], res["rates"], res["cost_s_per_block"]
    mcost = res["manager_s_per_block"]
    print(f"\n## {res['name']}: {res['unique']} unique blocks")
    print("| policy | " + " | ".join(f"{f:.0%} ({c})" for f, c in zip(fr, caps))
          + " | policy cost/block vs LRU | manager cost/block vs LRU |")
    print("|---" * (len(fr) + 3) + "|")
    lru_cost = sum(cost["lru"]) / len(cost["lru"]) if cost.get("lru") else None
    for p, r in rates.items():
        if p in cost and lru_cost:
            c = sum(cost[p]) / len(cost[p])
            ctxt = f"{c * 1e9:.0f} ns ({c / lru_cost:.2f}x)"
            mc = mcost[p]
            ctxt += f" | {mc * 1e9:.0f} ns ({mc / mcost['lru']:.2f}x)" if "lru" in mcost else " | -"
        else:
            ctxt = "- | -"
        print(f"| {p} | " + " | ".join(f"{x:.4f}" for x in r) + f" | {ctxt} |")
    if "lru" in rates and "opt" in rates:
        half = [(a + b) / 2 for a, b in zip(rates["lru"], rates["opt"])]
        print("| half-gap target | " + " | ".join(f"{x:.4f}" for x in half) + " | | |")
    print(f"(manager cost at capacity {res['manager_capacity']}, best of {MANAGER_REPEATS})")


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.5), squeeze=False)
    for ax, res in zip(axes[0], results):
        xs = [f * 100 for f in res["fractions"]]
        for p, r in res["rates"].items():
            style = "k--" if p == "opt" else "-o"
            ax.plot(xs, r, style, label=p, markersize=3)
        ax.set_xscale("log")
        ax.set_xlabel("capacity (% of unique blocks)")
        ax.set_ylabel("prefix hit rate")
        ax.set_title(res["name"])
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"\nplot: {path}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake-format JSONL trace")
    ap.add_argument("--fractions", type=float, nargs="+", default=list(FRACTIONS),
                    help="capacities as shares of the unique blocks")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES))
    ap.add_argument("--no-chat", action="store_true", help="skip the generated chat workload")
    ap.add_argument("--chat-seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--chat-sessions", type=int, default=2000)
    ap.add_argument("--plot", type=Path, default=ROOT / "docs" / "img" / "policies_hit_rate.png")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures as JSON")
    args = ap.parse_args(argv)
    for p in args.policies:
        get_policy_class(p)  # fail early, naming the unknown policy
    results = [sweep(f"Mooncake ({args.trace.name})", load_mooncake(args.trace), args.fractions,
                     args.policies)]
    if not args.no_chat:
        for seed in args.chat_seeds:
            reqs = load_chat(seed, args.chat_sessions)
            results.append(sweep(f"chat(seed={seed}, sessions={args.chat_sessions})", reqs,
                                 args.fractions, args.policies))
    for res in results:
        report(res)
    if args.plot:
        plot(results, args.plot)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
