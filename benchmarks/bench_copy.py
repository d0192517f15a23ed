"""Copy bandwidth of the CPU tier worker vs a plain Tensor.copy_.

For each chunk size, stores and loads the same total bytes as randomly
placed chunks (random GPU blocks -> random pool slots, so nothing merges)
through CPUOffloadingWorker, and copies the same number of bytes with one
contiguous dst.copy_(src) in the same run. Rounds interleave the three so
machine noise hits them alike; medians are reported. Goal: ratio >= 0.9
for chunks >= 256 KiB.

    .venv/bin/python benchmarks/bench_copy.py --plot out/bench_copy.png
"""

from __future__ import annotations

import argparse
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
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--plot", help="write a PNG plot here")
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
    tensors = [torch.randint(-128, 128, (2 * n, page), dtype=torch.int8, generator=gen) for _ in range(args.layers)]
    kv = make_kv_caches(tensors)
    cfg = OffloadingConfig.from_dict({"groups": [16], "tokens_per_hash": 16})
    worker = CPUOffloadingWorker(kv, cfg, 2 * n)
    rng = np.random.default_rng(0)
    blocks = rng.permutation(2 * n)[:n]
    slots = rng.permutation(2 * n)[:n]
    per = args.chunks_per_job
    jobs = [(GPULoadStoreSpec(blocks[i : i + per]), CPULoadStoreSpec(slots[i : i + per])) for i in range(0, n, per)]
    nbytes = n * page * args.layers
    ref_src = torch.randint(-128, 128, (nbytes,), dtype=torch.int8, generator=gen)
    ref_dst = torch.zeros_like(ref_src)
    job_id = 0

    def run(direction):
        nonlocal job_id
        ids = set()
        for gpu, cpu in jobs:
            job_id += 1
            ok = worker.submit_store(job_id, gpu, cpu) if direction == "store" else worker.submit_load(job_id, cpu, gpu)
            assert ok, worker.last_error
            ids.add(job_id)
        worker.wait(ids)
        results = worker.get_finished()
        assert all(r.success for r in results) and sum(r.transfer_size for r in results) == nbytes

    times = {"copy_": [], "store": [], "load": []}
    run("store"), run("load"), ref_dst.copy_(ref_src)  # warm up
    for _ in range(args.rounds):
        times["copy_"].append(timed(lambda: ref_dst.copy_(ref_src)))
        times["store"].append(timed(lambda: run("store")))
        times["load"].append(timed(lambda: run("load")))
        bar.update(1)
    # bit-exact check: the first layer's pages sit at the start of their slots
    pool_pages = worker.pool.tensor[:, :page].view(torch.int8)
    assert torch.equal(tensors[0][blocks], pool_pages[slots])
    worker.shutdown()
    gbps = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
    return {"chunk_kib": chunk_bytes // KiB, **gbps,
            "store_ratio": gbps["store"] / gbps["copy_"], "load_ratio": gbps["load"] / gbps["copy_"]}


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
    b.plot(x, [r["store_ratio"] for r in rows], "o-", label="store / copy_")
    b.plot(x, [r["load_ratio"] for r in rows], "s-", label="load / copy_")
    b.axhline(0.9, color="r", ls=":", label="goal 0.9 (>= 256 KiB)")
    b.set(xscale="log", xlabel="chunk size (KiB)", ylabel="ratio", title="ratio to Tensor.copy_, same run")
    b.set_xticks(x, [str(v) for v in x])
    b.set_ylim(0, max(1.2, max(max(r["store_ratio"], r["load_ratio"]) for r in rows) * 1.1))
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def main():
    args = parse_args()
    torch.set_num_threads(1)  # copy_ single-threaded, like the worker's one transfer thread
    rows = []
    with tqdm(total=len(args.sizes_kib) * args.rounds, desc="copy bench", unit="round") as bar:
        for kib in args.sizes_kib:
            rows.append(bench_size(kib * KiB, args, bar))
    print(f"\n{args.total_mib} MiB per measurement, {args.layers} layer(s) per chunk, "
          f"{args.chunks_per_job} chunks per job, median of {args.rounds} interleaved rounds")
    print(f"{'chunk':>8} {'copy_ GB/s':>11} {'store GB/s':>11} {'load GB/s':>10} {'store/copy_':>12} {'load/copy_':>11}")
    for r in rows:
        print(f"{r['chunk_kib']:>5} KiB {r['copy_']:>11.2f} {r['store']:>11.2f} {r['load']:>10.2f} "
              f"{r['store_ratio']:>12.2f} {r['load_ratio']:>11.2f}")
    big = [r for r in rows if r["chunk_kib"] >= 256]
    if big:
        worst = min(min(r["store_ratio"], r["load_ratio"]) for r in big)
        print(f"worst ratio for chunks >= 256 KiB: {worst:.2f} (goal >= 0.9): {'met' if worst >= 0.9 else 'NOT met'}")
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
