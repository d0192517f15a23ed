"""Manager overhead: microseconds per block for the whole scheduler-side
lifecycle, ours against vLLM 0.33's own CPUOffloadingManager, same stream.

Stream (seeded): requests made of a shared document prefix (Zipf popularity)
plus a fresh suffix, or the next turn of an earlier conversation (its whole
history plus new blocks). Both managers are driven identically, the way
vLLM 0.33's scheduler drives its manager (it never calls touch: recency is
committed in on_request_finished, by both):
    on_new_request
    lookup() each key until the first miss
    prepare_load(hits) -> complete_load(set(hits))
    prepare_store(the rest) in steps of --step-blocks blocks; each step's
        complete_store(set(keys_to_store)) arrives --lag steps later
    on_request_finished once its last store has landed
Every key's end-token position is set on the request context, as vLLM's
scheduler does. Only manager calls run inside the timed loop; keys and
contexts are built beforehand. The figure is the timed loop's thread CPU
time per block (wall time is printed too; on a shared machine it mostly
measures the neighbours). Best of --repeats, which go round the policies
(each policy and its vLLM run, then the next), so policies share the noise too.

vLLM runs in its own venv (--vllm-python), as a subprocess that imports it
once and then runs the same driver (this file) on the same stream on
request, so the two sides alternate and share the machine's noise.

    .venv/bin/python benchmarks/bench_manager.py --vllm-python /work/venv-vllm033/bin/python
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

GROUP = (0).to_bytes(4, "big")
TOKENS_PER_BLOCK = 16


def make_stream(n_blocks: int, seed: int, n_docs: int = 400) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Block ids per request (flat + offsets) and one 32-byte hash per id."""
    rng = np.random.default_rng(seed)
    next_id = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    docs = [fresh(int(n)) for n in rng.integers(4, 96, n_docs)]
    weights = 1.0 / np.arange(1, n_docs + 1) ** 1.1
    weights /= weights.sum()
    convs: list[list[int]] = []
    requests: list[list[int]] = []
    total = 0
    while total < n_blocks:
        if convs and rng.random() < 0.35:
            i = int(rng.integers(len(convs)))
            req = convs[i] + fresh(int(rng.integers(2, 24)))
            convs[i] = req
        else:
            req = docs[int(rng.choice(n_docs, p=weights))] + fresh(int(rng.integers(1, 48)))
            convs.append(req)
            if len(convs) > 300:
                convs.pop(0)
        req = req[:512]  # context limit
        requests.append(req)
        total += len(req)
    offsets = np.cumsum([0] + [len(r) for r in requests]).astype(np.int64)
    flat = np.fromiter((b for r in requests for b in r), dtype=np.int64, count=int(offsets[-1]))
    hashes = rng.integers(0, 256, (next_id, 32), dtype=np.uint8)
    return flat, offsets, hashes


def load_requests(path: str) -> list[list[bytes]]:
    data = np.load(path)
    flat, offsets, hashes = data["flat"], data["offsets"], data["hashes"]
    key_of = [h.tobytes() + GROUP for h in hashes]
    return [[key_of[b] for b in flat[offsets[i]: offsets[i + 1]]] for i in range(len(offsets) - 1)]


def run(manager, ReqContext, HIT, requests, step_blocks: int, lag: int, progress: bool) -> dict:
    """Drive one manager through the stream; returns timings and counts."""
    import gc

    ctxs = []
    for i, keys in enumerate(requests):
        ctx = ReqContext(req_id=f"r{i}")
        for pos, k in enumerate(keys):
            ctx.set_offload_key_position(k, (pos + 1) * TOKENS_PER_BLOCK)
        ctxs.append(ctx)
    cum = np.cumsum([0] + [len(r) for r in requests]).tolist()  # blocks before request i
    n_blocks = cum[-1]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=n_blocks, unit="blk", unit_scale=True, mininterval=0.5, leave=False, file=sys.stderr)
    m = manager
    lookup, prepare_load, complete_load = m.lookup, m.prepare_load, m.complete_load
    prepare_store, complete_store = m.prepare_store, m.complete_store
    hits = stored = failed = evicted = 0
    inflight: list[tuple[set, int]] = []  # (keys, request) of stores not yet completed
    open_stores = [0] * len(requests)  # stores in flight per request
    shown = 0

    def complete_oldest() -> None:
        done_keys, j = inflight.pop(0)
        complete_store(done_keys, ctxs[j])
        open_stores[j] -= 1
        if open_stores[j] == 0:  # its last store landed; a request outlives its prefill
            m.on_request_finished(ctxs[j])

    gc.collect()
    gc.freeze()  # setup objects out of the collector's way, as vLLM does after start-up
    t0, c0 = time.perf_counter(), time.thread_time()
    for i, (keys, ctx) in enumerate(zip(requests, ctxs)):
        m.on_new_request(ctx)
        n_hit = 0
        for k in keys:
            if lookup(k, ctx) is not HIT:
                break
            n_hit += 1
        if n_hit:
            hit_keys = keys[:n_hit]
            prepare_load(hit_keys, ctx)
            complete_load(set(hit_keys), ctx)
            hits += n_hit
        open_stores[i] = 1  # held open until all its store steps were submitted
        for s in range(n_hit, len(keys), step_blocks):
            out = prepare_store(keys[s: s + step_blocks], ctx)
            if out is None:
                failed += 1
            elif out.keys_to_store:
                evicted += len(out.evicted_keys)
                stored += len(out.keys_to_store)
                inflight.append((set(out.keys_to_store), i))
                open_stores[i] += 1
            while len(inflight) > lag:
                complete_oldest()
        open_stores[i] -= 1
        if open_stores[i] == 0:
            m.on_request_finished(ctx)
        if bar is not None and i % 64 == 0:
            bar.update(cum[i + 1] - shown)
            shown = cum[i + 1]
    while inflight:
        complete_oldest()
    elapsed, cpu = time.perf_counter() - t0, time.thread_time() - c0
    gc.unfreeze()
    if bar is not None:
        bar.close()
    # CPU time of this thread: the machine is shared, wall time counts other jobs too
    return {"seconds": elapsed, "cpu_seconds": cpu, "us_per_block": cpu / n_blocks * 1e6,
            "wall_us_per_block": elapsed / n_blocks * 1e6, "blocks": n_blocks,
            "requests": len(requests), "hit_blocks": hits, "stored_blocks": stored,
            "evicted_blocks": evicted, "failed_stores": failed}


def run_ours(policy: str, requests, args) -> dict:
    from kvoffload.abstractions import LookupResult, ReqContext
    from kvoffload.tiers.cpu.manager import CPUOffloadingManager

    m = CPUOffloadingManager(args.capacity, policy)
    return run(m, ReqContext, LookupResult.HIT, requests, args.step_blocks, args.lag, not args.no_progress)


def run_vllm(policy: str, requests, args) -> dict:
    from vllm.v1.kv_offload.base import LookupResult, ReqContext
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    m = CPUOffloadingManager(num_chunks=args.capacity, cache_policy=policy)
    return run(m, ReqContext, LookupResult.HIT, requests, args.step_blocks, args.lag, not args.no_progress)


def vllm_policy(policy: str) -> str:
    """vLLM 0.33 has lru and arc; any other policy of ours is held to its lru."""
    return policy if policy in ("lru", "arc") else "lru"


def serve_vllm(args) -> None:
    """Subprocess side: import vLLM once, then run on request ("lru"/"arc")."""
    import vllm.v1.kv_offload.cpu.manager  # noqa: F401  (import cost outside the runs)

    requests = load_requests(args.stream)
    args.capacity = int(args.capacity)  # (one capacity per process)
    print(json.dumps({"ready": True, "vllm": __import__("vllm").__version__}), flush=True)
    for line in sys.stdin:
        policy = line.strip()
        if not policy:
            break
        print(json.dumps(run_vllm(policy, requests, args)), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=200_000, help="blocks in the stream (default 200k)")
    ap.add_argument("--capacity", default="16384",
                    help="CPU chunks (default 16384); several, comma-separated, sweep them (one vLLM process each)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--step-blocks", type=int, default=16, help="blocks per prepare_store call")
    ap.add_argument("--lag", type=int, default=4, help="stores in flight before the oldest completes")
    ap.add_argument("--policies", default="lru,arc")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of every policy (ours and vLLM's); the best counts")
    ap.add_argument("--vllm-python", help="python of a venv with vLLM 0.33 (omit to time ours only)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--plot", help="also draw a bar chart (PNG) here")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--serve-vllm", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--stream", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_vllm:
        serve_vllm(args)
        return

    capacities = [int(c) for c in str(args.capacity).split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        stream = str(Path(tmp) / "stream.npz")
        flat, offsets, hashes = make_stream(args.blocks, args.seed)
        np.savez(stream, flat=flat, offsets=offsets, hashes=hashes)
        requests = load_requests(stream)
        by_capacity = {}
        for capacity in capacities:
            print(f"stream: {len(requests)} requests, {len(flat)} blocks, {len(hashes)} distinct; "
                  f"capacity {capacity} chunks, {args.step_blocks} blocks per store, lag {args.lag}")
            by_capacity[capacity] = measure(args, capacity, requests, stream)
    results = by_capacity[capacities[0]] if len(capacities) == 1 else {str(c): r for c, r in by_capacity.items()}
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    if args.plot:
        if len(capacities) == 1:
            plot(results, args.plot, f"{args.blocks} blocks, capacity {capacities[0]} chunks")
        else:
            plot_sweep(by_capacity, args.plot, f"{args.blocks} blocks")


def measure(args, capacity: int, requests, stream: str) -> dict:
    """Every policy, ours (and vLLM's beside it), at one capacity: printed, and returned."""
    args = argparse.Namespace(**{**vars(args), "capacity": capacity})
    proc = None
    if args.vllm_python:
        cmd = [args.vllm_python, __file__, "--serve-vllm", "--stream", stream,
               "--capacity", str(capacity), "--step-blocks", str(args.step_blocks),
               "--lag", str(args.lag)] + (["--no-progress"] if args.no_progress else [])
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                env={**__import__("os").environ, "VLLM_TARGET_DEVICE": "cpu"})
        hello = json.loads(proc.stdout.readline())
        print(f"vLLM {hello['vllm']} from {args.vllm_python}")
    policies = args.policies.split(",")
    runs = {p: ([], []) for p in policies}  # policy -> (ours, vLLM's)
    # Repeats go round the policies (lru, hubchain, lru, hubchain, ...), each
    # beside its vLLM run: a ratio then compares runs that shared the same
    # stretch of the machine's load, not one policy's quiet minute to another's busy one.
    for r in range(args.repeats):
        for policy in policies:
            ours, ref = runs[policy]
            ours.append(run_ours(policy, requests, args))
            if proc is not None:
                proc.stdin.write(vllm_policy(policy) + "\n")
                proc.stdin.flush()
                ref.append(json.loads(proc.stdout.readline()))
    results = {}
    for policy in policies:
        ours, ref = runs[policy]
        best = min(ours, key=lambda x: x["us_per_block"])
        line = (f"{policy}: ours {best['us_per_block']:.2f} us/block "
                f"(hit {best['hit_blocks'] / best['blocks']:.1%}, evicted {best['evicted_blocks']})")
        res = {"ours": best, "ours_all_us": [x["us_per_block"] for x in ours]}
        if ref:
            vbest = min(ref, key=lambda x: x["us_per_block"])
            ratio = best["us_per_block"] / vbest["us_per_block"]
            # runs alternate ours/vLLM, so each pair shared the machine's load
            paired = float(np.median([o["us_per_block"] / v["us_per_block"] for o, v in zip(ours, ref)]))
            line += (f"  vLLM {vllm_policy(policy)} {vbest['us_per_block']:.2f} us/block (hit {vbest['hit_blocks'] / vbest['blocks']:.1%},"
                     f" evicted {vbest['evicted_blocks']})  ratio ours/vLLM {ratio:.2f} best-of,"
                     f" {paired:.2f} median of pairs ({'meets' if ratio <= 0.5 else 'misses'} goal <= 0.5)")
            res.update(vllm=vbest, vllm_all_us=[x["us_per_block"] for x in ref], ratio=ratio,
                       paired_median_ratio=paired, vllm_policy=vllm_policy(policy))
        if "lru" in results and policy != "lru":  # per-block cost against our LRU, same run
            lru_us = results["lru"]["ours"]["us_per_block"]
            res["vs_our_lru"] = best["us_per_block"] / lru_us
            paired_lru = float(np.median([o / x for o, x in zip(res["ours_all_us"], results["lru"]["ours_all_us"])]))
            res["vs_our_lru_paired_median"] = paired_lru
            line += f"  vs our lru {res['vs_our_lru']:.2f}x best-of, {paired_lru:.2f}x median of pairs"
        print(line, flush=True)
        results[policy] = res
    if proc is not None:
        proc.stdin.close()
        proc.wait()
    return results


def plot_sweep(by_capacity: dict, path: str, subtitle: str) -> None:
    """Per policy, against the capacity: ours/vLLM's (goal <= 0.5) and ours
    against our LRU (a default's limit, 1.5x), where the runs have them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    caps = sorted(by_capacity)
    policies = list(by_capacity[caps[0]])
    panels = [("ratio", "ours / vLLM 0.33's (its lru for policies it lacks)", 0.5),
              ("vs_our_lru", "ours / our lru", 1.5)]
    panels = [p for p in panels if any(p[0] in by_capacity[c][q] for c in caps for q in policies)]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.4), squeeze=False)
    colors = dict(zip(policies, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4))  # one per policy, both panels
    for ax, (key, label, goal) in zip(axes[0], panels):
        for q in policies:
            pts = [(c, by_capacity[c][q][key]) for c in caps if key in by_capacity[c][q]]
            if pts:
                ax.plot([c for c, _ in pts], [v for _, v in pts], marker="o", label=q, color=colors[q])
        ax.axhline(goal, color="grey", linestyle="--", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("capacity (chunks)")
        ax.set_ylabel(label, fontsize=8)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    fig.suptitle(f"Manager overhead by capacity (lower is better; dashed: goal)\n{subtitle}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot(results: dict, path: str, subtitle: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = list(results)
    x = np.arange(len(policies))
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ours = [results[p]["ours"]["us_per_block"] for p in policies]
    ax.bar(x - 0.2, ours, 0.4, label="kvoffload")
    if all("vllm" in results[p] for p in policies):
        ref = [results[p]["vllm"]["us_per_block"] for p in policies]
        ax.bar(x + 0.2, ref, 0.4, label="vLLM 0.33")
        for i, p in enumerate(policies):
            ax.text(x[i], max(ours[i], ref[i]) * 1.03, f"ours/vLLM {results[p]['ratio']:.2f}", ha="center")
        ax.set_ylim(0, max(ours + ref) * 1.2)
    ax.set_xticks(x, policies)
    ax.set_ylabel("CPU us per block (lower is better)")
    ax.set_title(f"Manager overhead, full lifecycle\n{subtitle}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
