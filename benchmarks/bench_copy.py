"""Copy bandwidth of the CPU tier worker vs a plain Tensor.copy_.

For each chunk size, stores and loads the same total bytes as randomly
placed chunks (random GPU blocks -> random pool slots, so nothing merges)
through CPUOffloadingWorker, and copies the same number of bytes with
contiguous dst.copy_(src) calls in the same run. Each repeat moves the
bytes in segments (whole jobs, at least --segment-mib each) and times, per
segment, our store, our load, a bare memmove loop over the same chunks
("direct") and the copy_ of the segment's bytes, in an order that rotates
from segment to segment, so that the swings of a shared machine hit every
way alike. Ratios are the median over repeats of ours / copy_ within one
repeat, with their interquartile range. Goal (issue 18): ratio >= 0.95 for
32-chunk jobs of chunks >= 256 KiB. --fallback adds a second worker on the
same tensors with the C copy extension off (KVOFFLOAD_NATIVE_COPY=0: the
ctypes loop), its store and load interleaved with the others.

    .venv/bin/python benchmarks/bench_copy.py --plot out/bench_copy.png
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time

import numpy as np
import torch
from tqdm import tqdm

from kvoffload.abstractions import CPULoadStoreSpec, GPULoadStoreSpec
from kvoffload.config import OffloadingConfig
from kvoffload.kv_caches import make_kv_caches
from kvoffload.tiers.cpu.worker import CPUOffloadingWorker

KiB = 1024


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-kib", type=int, nargs="+", default=[64, 128, 256, 512, 1024, 2048],
                   help="chunk sizes in KiB")
    p.add_argument("--total-mib", type=int, default=256, help="bytes moved per measurement")
    p.add_argument("--layers", type=int, default=1, help="layers per chunk (each holds chunk/layers bytes)")
    p.add_argument("--chunks-per-job", type=int, default=32)
    p.add_argument("--rounds", type=int, default=11, help="repeats (each moves --total-mib every way)")
    p.add_argument("--segment-mib", type=int, default=32,
                   help="bytes of one timed segment (whole jobs); the ways alternate per segment")
    p.add_argument("--poll-ms", type=float, metavar="MS",
                   help="collect jobs by polling get_finished every MS ms (vLLM's way: the copy thread does "
                        "every copy) instead of wait() (which copies the jobs still queued in the caller)")
    p.add_argument("--fallback", action="store_true",
                   help="also time a worker without the C copy extension (KVOFFLOAD_NATIVE_COPY=0), interleaved")
    p.add_argument("--plot", help="write a PNG plot here")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where the engine's KV tensors live (cuda: the worker's stream path)")
    p.add_argument("--strategies", action="store_true",
                   help="instead: compare scatter/gather strategies for a store, one thread, no worker")
    return p.parse_args()


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_size(chunk_bytes: int, args, bar) -> dict:
    n = args.total_mib * 2**20 // chunk_bytes
    page = chunk_bytes // args.layers
    gen = torch.Generator().manual_seed(chunk_bytes)
    # the "engine": 2n blocks per layer, filled with random bytes (touched)
    tensors = [torch.randint(-128, 128, (2 * n, page), dtype=torch.int8, generator=gen).to(args.device)
               for _ in range(args.layers)]
    kv = make_kv_caches(tensors)
    cfg = OffloadingConfig.from_dict({"groups": [16], "tokens_per_hash": 16})
    worker = CPUOffloadingWorker(kv, cfg, 2 * n)
    workers = {"": worker}
    if args.fallback:  # the same tensors, its own pool, the ctypes loop (the env var is read per worker)
        old = os.environ.get("KVOFFLOAD_NATIVE_COPY")
        os.environ["KVOFFLOAD_NATIVE_COPY"] = "0"
        try:
            workers["_fb"] = CPUOffloadingWorker(kv, cfg, 2 * n)
        finally:
            if old is None:
                del os.environ["KVOFFLOAD_NATIVE_COPY"]
            else:
                os.environ["KVOFFLOAD_NATIVE_COPY"] = old
    if args.device == "cpu":
        how = {k: "C extension" if w.copier._native else "ctypes loop" for k, w in workers.items()}
        print(f"\n{chunk_bytes // KiB} KiB: " + ", ".join(f"worker{k}: {v}" for k, v in how.items()))
    rng = np.random.default_rng(0)
    blocks = rng.permutation(2 * n)[:n]
    slots = rng.permutation(2 * n)[:n]
    per = args.chunks_per_job
    jobs = [(GPULoadStoreSpec(blocks[i : i + per]), CPULoadStoreSpec(slots[i : i + per])) for i in range(0, n, per)]
    # segments: runs of whole jobs of at least --segment-mib each (one segment if a job is larger)
    seg_jobs = max(1, -(-args.segment_mib * 2**20 // (per * chunk_bytes)))
    segments = [range(a, min(len(jobs), a + seg_jobs)) for a in range(0, len(jobs), seg_jobs)]
    seg_chunks = [range(s.start * per, min(n, s.stop * per)) for s in segments]
    nbytes = n * page * args.layers
    # reference: the same bytes, one contiguous copy_ per segment in the same direction (device <-> pinned
    # host on CUDA); each segment copies its own span of the reference buffers, so nothing is cache-hot
    ref_dev = torch.randint(-128, 128, (nbytes,), dtype=torch.int8, generator=gen).to(args.device)
    ref_host = torch.zeros(nbytes, dtype=torch.int8, pin_memory=args.device == "cuda")
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    job_id = 0
    thread_seconds = {f"{d}{k}": 0.0 for k in workers for d in ("store", "load")}  # the jobs' own copy time

    def run(direction: str, seg: range, which: str = "") -> None:
        nonlocal job_id
        worker = workers[which]
        ids = set()
        for gpu, cpu in jobs[seg.start : seg.stop]:
            job_id += 1
            ok = worker.submit_store(job_id, gpu, cpu) if direction == "store" else worker.submit_load(job_id, cpu, gpu)
            assert ok, worker.last_error
            ids.add(job_id)
        if args.poll_ms:  # as vLLM does: the copy thread copies, the caller collects
            results = []
            while len(results) < len(ids):
                time.sleep(args.poll_ms / 1e3)
                results += worker.get_finished()
        else:  # wait() copies the jobs still queued in this thread
            worker.wait(ids)
            results = worker.get_finished()
        assert all(r.success for r in results) and {r.job_id for r in results} == ids
        thread_seconds[direction + which] += sum(r.transfer_time for r in results)

    # "direct": the same chunks stored by a memmove loop in this thread, no
    # worker (what random placement itself costs against one contiguous copy_)
    pool_base, slot = worker.pool.tensor.data_ptr(), worker.pool.chunk_bytes
    pairs = [(pool_base + int(s) * slot + layer * page, t.data_ptr() + int(b) * page)
             for b, s in zip(blocks, slots) for layer, t in enumerate(tensors)]

    def direct(c: range) -> None:
        mm = ctypes.memmove
        for dst, src in pairs[c.start * args.layers : c.stop * args.layers]:
            mm(dst, src, page)

    def ref(direction: str, c: range) -> None:
        a, b = c.start * page * args.layers, c.stop * page * args.layers
        dst, src = (ref_host, ref_dev) if direction != "load" else (ref_dev, ref_host)
        dst[a:b].copy_(src[a:b], non_blocking=True)
        sync()

    cuda = args.device == "cuda"
    # each way of one segment: what it runs, given the segment's index
    ways = {"store": lambda i: run("store", segments[i]), "load": lambda i: run("load", segments[i]),
            "copy_": lambda i: ref("store", seg_chunks[i])}
    if args.fallback:
        ways["store_fb"] = lambda i: run("store", segments[i], "_fb")
        ways["load_fb"] = lambda i: run("load", segments[i], "_fb")
    if cuda:  # the reference differs by direction on a GPU
        ways["copy_load"] = lambda i: ref("load", seg_chunks[i])
    else:
        ways["direct"] = lambda i: direct(seg_chunks[i])
    names = list(ways)
    for i in range(len(segments)):  # warm up: every way once over all the bytes
        for name in names:
            ways[name](i)
    runs = []  # per repeat: GB/s of each way over all its segments
    for rep in range(args.rounds):
        secs = dict.fromkeys(names, 0.0)
        thread_seconds.update(dict.fromkeys(thread_seconds, 0.0))
        for i in range(len(segments)):
            k = (rep + i) % len(names)  # rotate the order, so swings of the machine hit every way alike
            for name in names[k:] + names[:k]:
                t0 = time.perf_counter()
                ways[name](i)
                secs[name] += time.perf_counter() - t0
        runs.append({**{name: nbytes / t / 1e9 for name, t in secs.items()},
                     **{f"{d}_thread": nbytes / t / 1e9 for d, t in thread_seconds.items()}})
        bar.update(1)
    # bit-exact check: the first layer's pages sit at the start of their slots
    for w in workers.values():
        pool_pages = w.pool.tensor[:, :page].view(torch.int8)
        assert torch.equal(tensors[0][torch.from_numpy(blocks).to(args.device)].cpu(), pool_pages[slots])
        w.shutdown()
    row = {"chunk_kib": chunk_bytes // KiB, "runs": runs, **{k: statistics.median(r[k] for r in runs) for k in runs[0]}}
    # ratios: per repeat, ours against the reference of the same repeat; median and interquartile range
    pairs_ = {"store": "copy_", "load": "copy_load" if cuda else "copy_"}
    if not cuda:
        pairs_.update(direct="copy_", store_vs_direct="direct")
    if args.fallback:  # the fallback over copy_, and the extension over the fallback
        pairs_.update(store_fb="copy_", load_fb=pairs_["load"], store_vs_fb="store_fb", load_vs_fb="load_fb")
    for k, base in pairs_.items():
        mine = k.split("_vs_")[0]
        v = [r[mine] / r[base] for r in runs]
        q = statistics.quantiles(v, n=4, method="inclusive") if len(v) > 1 else [v[0]] * 3
        row[f"{k}_ratio"], row[f"{k}_iqr"] = statistics.median(v), (q[0], q[2])
    return row


def bench_strategies(chunk_bytes: int, args, bar) -> dict:
    """A store of n random blocks into n random pool rows, done four ways;
    each as a ratio to the copy_ of the same bytes right before it."""
    n = args.total_mib * 2**20 // chunk_bytes
    gen = torch.Generator().manual_seed(chunk_bytes)
    cache = torch.randint(-128, 128, (2 * n, chunk_bytes), dtype=torch.int8, generator=gen)
    pool = torch.randint(-128, 128, (2 * n, chunk_bytes), dtype=torch.int8, generator=gen)  # touched
    rng = np.random.default_rng(0)
    blocks, slots = rng.permutation(2 * n)[:n], rng.permutation(2 * n)[:n]
    ref_src, ref_dst = cache[:n].reshape(-1), pool[n:].reshape(-1)
    src_addr = (cache.data_ptr() + blocks * chunk_bytes).tolist()
    dst_addr = (pool.data_ptr() + slots * chunk_bytes).tolist()
    bl, sl = blocks.tolist(), slots.tolist()
    c64, p64 = cache.view(torch.int64), pool.view(torch.int64)
    bi, si = torch.from_numpy(blocks), torch.from_numpy(slots)
    staging = torch.empty(n, chunk_bytes // 8, dtype=torch.int64)  # preallocated

    def memmove_loop():  # what the worker runs without the C extension
        for d, s_ in zip(dst_addr, src_addr):
            ctypes.memmove(d, s_, chunk_bytes)

    def copy_loop():
        for b, s_ in zip(bl, sl):
            pool[s_].copy_(cache[b])

    def index_int64():
        torch.index_select(c64, 0, bi, out=staging)
        p64.index_copy_(0, si, staging)

    def advanced_indexing():  # allocates a temporary
        pool[si] = cache[bi]

    ways = {"memmove loop": memmove_loop, "copy_ loop": copy_loop,
            "index_select+index_copy_ int64": index_int64, "pool[slots] = cache[blocks]": advanced_indexing}
    from kvoffload.tiers.cpu.copy_cpu import _memcopy

    if _memcopy is not None:  # the C extension: every range in one call (what the worker runs when built)
        dst_off, src_off = (slots * chunk_bytes).astype(np.int64), (blocks * chunk_bytes).astype(np.int64)
        sizes = np.full(n, chunk_bytes, dtype=np.int64)
        ways = {"C extension": lambda: _memcopy.copy(pool.data_ptr(), dst_off, cache.data_ptr(), src_off, sizes),
                **ways}
    ratios = {k: [] for k in ways}
    for f in ways.values():
        f()
    for _ in range(args.rounds):
        for name, f in ways.items():
            ref = timed(lambda: ref_dst.copy_(ref_src))
            ratios[name].append(ref / timed(f))
        bar.update(1)
    assert torch.equal(pool[slots], cache[blocks])
    return {"chunk_kib": chunk_bytes // KiB, **{k: statistics.median(v) for k, v in ratios.items()}}


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["chunk_kib"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for k, style in (("copy_", "k--"), ("store", "o-"), ("load", "s-")):
        a.plot(x, [r[k] for r in rows], style, label=k if k != "copy_" else "Tensor.copy_ (reference)")
    a.set(xscale="log", xlabel="chunk size (KiB)", ylabel="GB/s", title="CPU tier worker copy bandwidth")
    a.set_xticks(x, [str(v) for v in x])
    a.legend()
    for k, style, label in (("store", "o-", "store / copy_"), ("load", "s-", "load / copy_")):
        med = [r[f"{k}_ratio"] for r in rows]
        lo, hi = zip(*(r[f"{k}_iqr"] for r in rows))
        b.errorbar(x, med, yerr=[[m - q for m, q in zip(med, lo)], [q - m for m, q in zip(med, hi)]],
                   fmt=style, capsize=3, label=label + " (median, IQR)")
    b.axhline(0.95, color="r", ls=":", label="goal 0.95 (>= 256 KiB)")
    b.set(xscale="log", xlabel="chunk size (KiB)", ylabel="ratio", title="ratio to Tensor.copy_, same run")
    b.set_xticks(x, [str(v) for v in x])
    b.set_ylim(0, max(1.2, max(max(r["store_iqr"][1], r["load_iqr"][1]) for r in rows) * 1.1))
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def main():
    args = parse_args()
    torch.set_num_threads(1)  # copy_ single-threaded, like the worker's one transfer thread
    rows = []
    bench = bench_strategies if args.strategies else bench_size
    with tqdm(total=len(args.sizes_kib) * args.rounds, desc="copy bench", unit="round") as bar:
        for kib in args.sizes_kib:
            rows.append(bench(kib * KiB, args, bar))
    if args.strategies:
        names = [k for k in rows[0] if k != "chunk_kib"]
        print(f"\nstore of random blocks into random rows, ratio to copy_ of the same bytes "
              f"(median of {args.rounds} rounds)")
        print(f"{'chunk':>8} " + " ".join(f"{k:>{max(len(k), 6)}}" for k in names))
        for r in rows:
            print(f"{r['chunk_kib']:>5} KiB " + " ".join(f"{r[k]:>{max(len(k), 6)}.2f}" for k in names))
        return
    cuda = args.device == "cuda"
    print(f"\n{args.total_mib} MiB per repeat, {args.layers} layer(s) per chunk, {args.chunks_per_job} chunks per "
          f"job, {args.rounds} repeats of segments of >= {args.segment_mib} MiB, the ways in rotating order")
    print("GB/s: median over repeats, end to end (submit to " + (f"get_finished polled every {args.poll_ms} ms)" if args.poll_ms else
          "wait())") + "; in brackets over the jobs' own copy time (TransferResult.transfer_time)")
    print("ratios: median over repeats of ours / copy_ in the same repeat [interquartile range]")
    if not cuda:
        print("direct: a memmove loop over the same chunks in the calling thread, no worker; "
              "store/direct: the worker's own overhead")
    iqr = lambda r, k: f"{r[k + '_ratio']:.2f} [{r[k + '_iqr'][0]:.2f}-{r[k + '_iqr'][1]:.2f}]"
    cols = ["store", "load"] + ([] if cuda else ["direct", "store_vs_direct"])
    if args.fallback:
        cols += ["store_fb", "load_fb", "store_vs_fb", "load_vs_fb"]
        print("fallback: a worker without the C extension (the ctypes loop); store/fallback: "
              "the extension's store over the fallback's in the same repeat")
    heads = {"store": "store/copy_", "load": "load/copy_", "direct": "direct/copy_", "store_vs_direct": "store/direct",
             "store_fb": "fallback store/copy_", "load_fb": "fallback load/copy_",
             "store_vs_fb": "store/fallback", "load_vs_fb": "load/fallback"}
    print(f"| chunk | copy_ GB/s | store GB/s (thread) | load GB/s (thread) | "
          + " | ".join(heads[c] for c in cols) + " |")
    print("|---:" * (4 + len(cols)) + "|")
    for r in rows:
        print(f"| {r['chunk_kib']} KiB | {r['copy_']:.2f} | {r['store']:.2f} ({r['store_thread']:.2f}) | "
              f"{r['load']:.2f} ({r['load_thread']:.2f}) | " + " | ".join(iqr(r, c) for c in cols) + " |")
    big = [r for r in rows if r["chunk_kib"] >= 256]
    if big:
        worst = min(min(r["store_ratio"], r["load_ratio"]) for r in big)
        print(f"worst median ratio for chunks >= 256 KiB: {worst:.2f} (goal >= 0.95): "
              f"{'met' if worst >= 0.95 else 'NOT met'}")
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
