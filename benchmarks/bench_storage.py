"""Storage tier benchmarks.

io:     write and read GB/s of the storage tier (manager + IO threads, O_DIRECT,
        checksums, durable index) for 256 KiB - 4 MiB chunks, as a ratio of
        `dd` with O_DIRECT on the same filesystem in the same run.
paced:  the shared Mooncake trace through TieringManager(CPU, storage) with
        real bytes, the IO waited for (an engine whose compute covers it): a
        CPU tier alone, then CPU + storage at several sizes and store
        thresholds: the hit rate the storage tier adds, and its bytes written.
replay: the same through `kvoffload replay`'s engine, which runs as fast as
        the managers allow (no compute time), so a slow tier drops stores.

    .venv/bin/python benchmarks/bench_storage.py io --dir /tmp/kvbench
    .venv/bin/python benchmarks/bench_storage.py paced --dir /tmp/kvbench
    .venv/bin/python benchmarks/bench_storage.py replay --dir /tmp/kvbench
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from kvoffload.abstractions import CPULoadStoreSpec, ReqContext
from kvoffload.keys import make_offload_key
from kvoffload.tiers.base import Namespace
from kvoffload.tiers.host_pool import HostPool
from kvoffload.tiers.storage.tier import StorageTier

TRACE = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
CHUNK_SIZES = (256 << 10, 1 << 20, 4 << 20)


# ---- io ---------------------------------------------------------------------

def _dd(args: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(["dd", *args, "status=none"], check=True)
    return time.perf_counter() - t


def dd_write(path: Path, bs: int, count: int) -> float:
    """dd's best case here: a new file (into preallocated unwritten extents
    dd at queue depth 1 is 10x slower, which would flatter the tier)."""
    path.unlink(missing_ok=True)
    return _dd(["if=/dev/zero", f"of={path}", f"bs={bs}", f"count={count}",
                "oflag=direct", "conv=fdatasync"])


def dd_read(path: Path, bs: int, count: int) -> float:
    return _dd([f"if={path}", "of=/dev/null", f"bs={bs}", f"count={count}", "iflag=direct"])


def _store_all(mgr, worker, keys, batch, ctx, first_job) -> float:
    t = time.perf_counter()
    jobs = {}
    for j, lo in enumerate(range(0, len(keys), batch), first_job):
        ks = keys[lo : lo + batch]
        out = mgr.prepare_store(ks, ctx)
        worker.submit_store(j, CPULoadStoreSpec(range(lo, lo + len(ks))), out.store_spec)
        jobs[j] = ks
    worker.wait(set(jobs))
    seconds = time.perf_counter() - t
    results = worker.get_finished()
    assert all(r.success for r in results), "store failed"
    for r in results:
        mgr.complete_store(jobs[r.job_id], ctx)
    return seconds


def tier_write_read(root: Path, pool: HostPool, batch: int, io_threads: int,
                    num_files: int) -> tuple[float, float, float]:
    """Seconds to store every pool chunk into fresh slab files, to store as
    many new keys again (each evicts an old one and overwrites its slot: the
    steady state of a full tier), then to load them all back."""
    shutil.rmtree(root, ignore_errors=True)
    bs, n = pool.chunk_bytes, pool.num_chunks
    ns = Namespace(model="bench", chunk_bytes=bs)
    tier = StorageTier(str(root), n * bs, bs, ns, io_threads=io_threads, num_files=num_files)
    mgr, worker = tier.get_manager(), tier.get_worker(pool)
    ctx = ReqContext("bench")
    keys = [make_offload_key(i.to_bytes(8, "big"), 0) for i in range(n)]
    again = [make_offload_key(i.to_bytes(8, "big"), 1) for i in range(n)]
    try:
        write_s = _store_all(mgr, worker, keys, batch, ctx, 0)
        overwrite_s = _store_all(mgr, worker, again, batch, ctx, 1 << 20)
        t = time.perf_counter()
        jobs = set()
        for j, lo in enumerate(range(0, n, batch), 2 << 20):
            ks = again[lo : lo + batch]
            worker.submit_load(j, mgr.prepare_load(ks, ctx), CPULoadStoreSpec(range(lo, lo + len(ks))))
            jobs.add(j)
        worker.wait(jobs)
        read_s = time.perf_counter() - t
        assert all(r.success for r in worker.get_finished()), "load failed (checksum?)"
    finally:
        worker.shutdown()
        mgr.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    return write_s, overwrite_s, read_s


def run_io(args) -> dict:
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    total = args.total_mib << 20
    rows = []
    steps = len(CHUNK_SIZES) * args.repeats
    bar = tqdm(total=steps, desc="storage io", disable=args.no_progress)
    for bs in CHUNK_SIZES:
        n = total // bs
        pool = HostPool(n, bs)
        pool.array[:] = np.random.default_rng(0).integers(0, 256, pool.array.shape[1], dtype=np.uint8)
        ddw, ddr, tw, tow, tr = [], [], [], [], []
        for _ in range(args.repeats):  # interleaved, so drift hits both alike
            f = root / "dd.bin"
            ddw.append(dd_write(f, bs, n))
            ddr.append(dd_read(f, bs, n))
            f.unlink()
            w, ow, r = tier_write_read(root / "tier", pool, args.batch, args.io_threads, args.num_files)
            tw.append(w)
            tow.append(ow)
            tr.append(r)
            bar.update()
        pool.close()
        gb = n * bs / 1e9
        row = {"chunk_bytes": bs, "total_bytes": n * bs,
               "dd_write_GBps": gb / statistics.median(ddw), "dd_read_GBps": gb / statistics.median(ddr),
               "tier_write_GBps": gb / statistics.median(tw), "tier_overwrite_GBps": gb / statistics.median(tow),
               "tier_read_GBps": gb / statistics.median(tr)}
        row["write_ratio"] = row["tier_write_GBps"] / row["dd_write_GBps"]
        row["overwrite_ratio"] = row["tier_overwrite_GBps"] / row["dd_write_GBps"]
        row["read_ratio"] = row["tier_read_GBps"] / row["dd_read_GBps"]
        rows.append(row)
    bar.close()
    print(f"{'chunk':>8} | {'dd write':>9} {'tier fresh':>10} {'ratio':>6} {'tier overwrite':>14} {'ratio':>6} | "
          f"{'dd read':>8} {'tier read':>9} {'ratio':>6}   (GB/s, median of {args.repeats})")
    for r in rows:
        print(f"{r['chunk_bytes'] >> 10:>6}Ki | {r['dd_write_GBps']:>9.2f} {r['tier_write_GBps']:>10.2f} "
              f"{r['write_ratio']:>6.2f} {r['tier_overwrite_GBps']:>14.2f} {r['overwrite_ratio']:>6.2f} | "
              f"{r['dd_read_GBps']:>8.2f} {r['tier_read_GBps']:>9.2f} {r['read_ratio']:>6.2f}")
    return {"io": rows, "io_threads": args.io_threads, "num_files": args.num_files, "batch_chunks": args.batch}


# ---- replay -----------------------------------------------------------------

def run_replay(args) -> dict:
    from kvoffload.replay.engine import EngineOptions, replay
    from kvoffload.replay.report import summary
    from kvoffload.replay.traces import load_trace

    trace = load_trace(str(args.trace), "auto", None, args.limit)
    unique = trace.num_unique_blocks()
    cpu = max(1, int(unique * args.cpu_share))
    chunk = 512 * args.kv_bytes_per_token  # mooncake blocks are 512 tokens
    configs = [("cpu only", None, None)]
    for share in args.storage_shares:
        for th in args.thresholds:
            configs.append((f"cpu + storage {share:.0%}, threshold {th}", share, th))
    rows = []
    for label, share, th in tqdm(configs, desc="replays", disable=args.no_progress):
        extra = {"num_cpu_chunks": cpu, "eviction_policy": "lru"}
        spec = "cpu"
        if share is not None:
            d = Path(args.dir) / "replay-storage"
            shutil.rmtree(d, ignore_errors=True)
            spec = "tiered"
            extra["secondary_tiers"] = [{"type": "storage", "path": str(d), "store_threshold": th,
                                         "max_queue_depth": args.max_queue_depth,
                                         "capacity_bytes": max(1, int(unique * share)) * chunk}]
        opts = EngineOptions(spec=spec, extra_config=extra, kv_bytes_per_token=args.kv_bytes_per_token,
                             progress=False)
        res = replay(trace, opts)
        s = summary(res)
        st = res.tiers.get("storage", {}).get("counters", {})
        rows.append({"config": label, "storage_share": share, "store_threshold": th,
                     "offload_prefix_hit_rate": s["offload_prefix_hit_rate"],
                     "storage_stored_bytes": st.get("stored_bytes", 0),
                     "storage_loaded_bytes": st.get("loaded_bytes", 0),
                     "storage_dropped": st.get("dropped_stores", 0),
                     "verify_failures": s["verify_failures"]})
        if share is not None:
            shutil.rmtree(Path(args.dir) / "replay-storage", ignore_errors=True)
    base = rows[0]["offload_prefix_hit_rate"]
    print(f"trace {trace.name}: {len(trace.requests)} requests, {unique} unique blocks, "
          f"CPU tier {cpu} blocks ({args.cpu_share:.0%})")
    print(f"{'config':<36} {'hit rate':>8} {'gain':>7} {'written to storage':>19} {'read':>9} {'dropped':>8}")
    for r in rows:
        print(f"{r['config']:<36} {r['offload_prefix_hit_rate']:>8.4f} "
              f"{r['offload_prefix_hit_rate'] - base:>+7.4f} {r['storage_stored_bytes'] / 1e9:>16.2f} GB "
              f"{r['storage_loaded_bytes'] / 1e9:>6.2f} GB {r['storage_dropped']:>8,}")
    return {"replay": rows, "max_queue_depth": args.max_queue_depth, "cpu_blocks": cpu, "unique_blocks": unique, "requests": len(trace.requests)}


def _leading_hits(mgr, keys, ctx) -> tuple[int, bool]:
    """Look up keys in order up to the first miss, as an engine does (storage
    hits start promotions): (leading keys readable in CPU now, any pending)."""
    from kvoffload.abstractions import LookupResult

    run, pending = 0, False
    for k in keys:
        r = mgr.lookup(k, ctx)
        if r is LookupResult.MISS:
            break
        if r is LookupResult.HIT and not pending:
            run += 1
        else:
            pending = True
    return run, pending


def paced_replay(trace, cpu_blocks: int, tier_conf: dict | None, chunk: int, wait_depth: int) -> dict:
    """The trace through TieringManager(CPU manager, storage tier) directly,
    with real bytes in a host pool. Request semantics of the trace README:
    look up all of a request's blocks at arrival (a storage hit is promoted
    and waited for), count the leading run of hits, then store the rest.
    The engine waits for the storage tier once wait_depth chunks are in
    flight: an engine whose compute time covers the IO (nothing dropped)."""
    from kvoffload.abstractions import ScheduleEndContext
    from kvoffload.tiering import Tier, TieringManager
    from kvoffload.tiers.cpu.manager import CPUOffloadingManager

    end = ScheduleEndContext((), ())
    pool = HostPool(cpu_blocks, chunk)
    cpu = CPUOffloadingManager(cpu_blocks)
    tiers = []
    if tier_conf is not None:
        st = StorageTier(tier_conf["path"], tier_conf["capacity_bytes"], pool.chunk_bytes,
                         Namespace(model="bench-replay", chunk_bytes=pool.chunk_bytes))
        tiers.append(Tier(st, store_threshold=tier_conf["store_threshold"], max_queue_depth=1 << 30))
    mgr = TieringManager(cpu, tiers)
    mgr.attach_workers([t.backend.get_worker(pool) for t in tiers])
    refs = hits = bad = 0
    try:
        for n, req in enumerate(trace.requests):
            ctx = ReqContext(str(n))
            mgr.on_new_request(ctx)
            keys = [make_offload_key(int(h).to_bytes(8, "big"), 0) for h in req.block_hashes]
            (run, waiting), rounds = _leading_hits(mgr, keys, ctx), 0
            while waiting and rounds < 8:
                mgr.on_schedule_end(end)  # promotions: submit, wait, look again
                mgr.wait_idle()
                (run, waiting), rounds = _leading_hits(mgr, keys, ctx), rounds + 1
            if run:  # "load" the hits: pin, check each chunk names its key, unpin
                slots = mgr.prepare_load(keys[:run], ctx).block_ids
                bad += sum(bytes(pool.array[int(s), :8]) != k[:8] for s, k in zip(slots, keys))
                mgr.complete_load(keys[:run], ctx)
                mgr.touch(keys[:run], ctx)
            refs += len(keys)
            hits += run
            out = mgr.prepare_store(keys[run:], ctx)
            if out is not None and out.keys_to_store:
                for k, s in zip(out.keys_to_store, out.store_spec.block_ids):
                    pool.array[int(s), :8] = np.frombuffer(k[:8], np.uint8)
                mgr.complete_store(out.keys_to_store, ctx)
            mgr.on_schedule_end(end)
            mgr.on_request_finished(ctx)
            if tiers and tiers[0].in_flight > wait_depth:
                mgr.wait_idle()
        mgr.wait_idle()
        stats = {c.tier: c.counters for c in mgr.get_stats().children}
    finally:
        mgr.shutdown()
        pool.close()
    st = stats.get("storage", {})
    return {"hit_rate": hits / refs, "bad_chunks": int(bad),
            "storage_stored_bytes": st.get("stored_bytes", 0), "storage_loaded_bytes": st.get("loaded_bytes", 0),
            "storage_dropped": st.get("dropped_stores", 0)}


def run_paced(args) -> dict:
    from kvoffload.replay.traces import load_trace

    trace = load_trace(str(args.trace), "auto", None, args.limit)
    unique = trace.num_unique_blocks()
    cpu = max(1, int(unique * args.cpu_share))
    chunk = 512 * args.kv_bytes_per_token
    configs = [("cpu only", None, None)] + [
        (f"cpu + storage {share:.0%}, threshold {th}", share, th)
        for share in args.storage_shares for th in args.thresholds]
    rows = []
    d = Path(args.dir) / "paced-storage"
    for label, share, th in tqdm(configs, desc="paced replays", disable=args.no_progress):
        shutil.rmtree(d, ignore_errors=True)
        conf = None if share is None else {"path": str(d), "store_threshold": th,
                                            "capacity_bytes": max(1, int(unique * share)) * chunk}
        r = paced_replay(trace, cpu, conf, chunk, args.wait_depth)
        rows.append({"config": label, "storage_share": share, "store_threshold": th, **r})
    shutil.rmtree(d, ignore_errors=True)
    from kvoffload.replay.oracle import simulate

    blocks = [r.block_hashes for r in trace.requests]
    for r in rows:  # reference: one LRU cache as large as the biggest tier
        cap = cpu if r["storage_share"] is None else max(cpu, int(unique * r["storage_share"]))
        r["lru_reference"] = simulate(blocks, cap, "lru").hit_rate
    base = rows[0]["hit_rate"]
    print(f"paced: {trace.name}, {len(trace.requests)} requests, {unique} unique blocks, "
          f"CPU tier {cpu} blocks ({args.cpu_share:.0%})")
    print(f"{'config':<36} {'hit rate':>8} {'gain':>7} {'LRU ref':>7} {'written to storage':>19} "
          f"{'read':>9} {'bad':>4}")
    for r in rows:
        print(f"{r['config']:<36} {r['hit_rate']:>8.4f} {r['hit_rate'] - base:>+7.4f} {r['lru_reference']:>7.4f} "
              f"{r['storage_stored_bytes'] / 1e9:>16.2f} GB {r['storage_loaded_bytes'] / 1e9:>6.2f} GB "
              f"{r['bad_chunks']:>4}")
    return {"paced": rows, "cpu_blocks": cpu, "unique_blocks": unique, "requests": len(trace.requests)}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [k for k in ("io", "paced", "replay") if k in result]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, k in zip(axes[0], panels):
        if k == "io":
            x = np.arange(len(result["io"]))
            bars = [("dd_write_GBps", "dd write"), ("tier_write_GBps", "tier write (fresh)"),
                    ("tier_overwrite_GBps", "tier write (overwrite)"),
                    ("dd_read_GBps", "dd read"), ("tier_read_GBps", "tier read")]
            for off, (key, label) in enumerate(bars):
                ax.bar(x + (off - 2) * 0.16, [r[key] for r in result["io"]], 0.16, label=label)
            ax.set_xticks(x, [f"{r['chunk_bytes'] >> 10} KiB" for r in result["io"]])
            ax.set_ylabel("GB/s (O_DIRECT)")
            ax.set_title("storage tier vs dd, same filesystem")
            ax.legend()
        else:
            rows = result[k]
            rate = "hit_rate" if k == "paced" else "offload_prefix_hit_rate"
            ax.barh([r["config"] for r in rows], [r[rate] for r in rows])
            ax.set_xlabel("prefix hit rate")
            ax.set_title("Mooncake trace, " + ("IO waited for" if k == "paced" else "kvoffload replay engine"))
            ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", nargs="?", choices=("io", "paced", "replay", "all"), default="all")
    p.add_argument("--dir", default="/tmp/kvoffload-bench-storage",
                   help="scratch directory on the filesystem to measure (removed afterwards)")
    p.add_argument("--total-mib", type=int, default=256, help="bytes per measured write/read, MiB")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch", type=int, default=16, help="chunks per store/load job")
    p.add_argument("--io-threads", type=int, default=4)
    p.add_argument("--num-files", type=int, default=4, help="slab files of the storage tier")
    p.add_argument("--trace", default=str(TRACE))
    p.add_argument("--limit", type=int, help="replay only the first N requests")
    p.add_argument("--cpu-share", type=float, default=0.01, help="CPU tier size, share of unique blocks")
    p.add_argument("--storage-shares", type=lambda s: [float(x) for x in s.split(",")], default=[0.05, 0.25])
    p.add_argument("--thresholds", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 3])
    p.add_argument("--kv-bytes-per-token", type=int, default=16)
    p.add_argument("--wait-depth", type=int, default=64,
                   help="paced: the engine waits for the storage tier beyond this many chunks in flight")
    p.add_argument("--max-queue-depth", type=int, default=256, help="storage chunks in flight before drops")
    p.add_argument("--out", default="out/bench_storage", help="JSON and PNG go here")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args()
    result: dict = {}
    if args.what in ("io", "all"):
        result.update(run_io(args))
    if args.what in ("paced", "all"):
        result.update(run_paced(args))
    if args.what in ("replay", "all"):
        result.update(run_replay(args))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.what}.json").write_text(json.dumps(result, indent=2))
    plot(result, out / f"{args.what}.png")
    print(f"results in {out}/{args.what}.json and .png")


if __name__ == "__main__":
    main()
