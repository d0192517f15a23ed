"""Storage tier benchmarks.

io:     store and load GB/s of the storage tier (manager + IO threads, O_DIRECT,
        checksums, the index's group commit) at 8 KiB, 256 KiB and 2 MiB
        chunks, side by side in one run with `dd` O_DIRECT (the same bytes,
        same filesystem) and with vLLM 0.33's own filesystem tier (run by
        storage_vllm_fs.py in the venv given by --vllm-python); the page
        cache is dropped before every load phase (needs root).
paced:  the shared Mooncake trace through TieringManager(CPU, storage) with
        real bytes, the IO waited for (an engine whose compute covers it): a
        CPU tier alone, then CPU + storage at several sizes and store
        thresholds: the hit rate the storage tier adds, and its bytes written.
replay: the same through `kvoffload replay`'s engine, which runs as fast as
        the managers allow (no compute time), so a slow tier drops stores.

    .venv/bin/python benchmarks/bench_storage.py io --dir /tmp/kvbench --vllm-python VENV/bin/python
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
CHUNK_SIZES = (8 << 10, 256 << 10, 2 << 20)


# ---- io ----------------------------------------------------------------------

VLLM_DRIVER = Path(__file__).resolve().parent / "storage_vllm_fs.py"


def drop_caches() -> None:
    """Write back, then drop the page cache, so a read phase reads the disk."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as e:
        raise SystemExit(f"cannot drop the page cache ({e}): run as root") from None


def _dd(args: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(["dd", *args, "status=none"], check=True)
    return time.perf_counter() - t


def dd_write_read(path: Path, bs: int, count: int) -> tuple[float, float]:
    """dd O_DIRECT into a new file (fdatasync'd at the end), then, the page
    cache dropped, O_DIRECT back: the disk's plain sequential rate at bs."""
    path.unlink(missing_ok=True)
    w = _dd(["if=/dev/zero", f"of={path}", f"bs={bs}", f"count={count}", "oflag=direct", "conv=fdatasync"])
    drop_caches()
    r = _dd([f"if={path}", "of=/dev/null", f"bs={bs}", f"count={count}", "iflag=direct"])
    path.unlink()
    return w, r


def _jobs(mgr, worker, keys, batch, ctx, first_job, store: bool) -> float:
    """Submit every key's job at once (as an engine with a deep queue would), wait for all."""
    t = time.perf_counter()
    jobs = {}
    for j, lo in enumerate(range(0, len(keys), batch), first_job):
        ks = keys[lo : lo + batch]
        chunks = CPULoadStoreSpec(range(lo, lo + len(ks)))
        if store:
            out = mgr.prepare_store(ks, ctx)
            worker.submit_store(j, chunks, out.store_spec)
        else:
            worker.submit_load(j, mgr.prepare_load(ks, ctx), chunks)
        jobs[j] = ks
    worker.wait(set(jobs))
    seconds = time.perf_counter() - t
    results = worker.get_finished()
    assert all(r.success for r in results), "a job failed (checksum?)"
    for r in results:
        (mgr.complete_store if store else mgr.complete_load)(jobs[r.job_id], ctx)
    return seconds


def tier_write_read(root: Path, pool: HostPool, batch: int, io_threads: int,
                    num_files: int) -> tuple[float, float, float]:
    """Seconds to store every pool chunk into fresh slab files (and commit
    the index), to store as many new keys again (each overwrites an evicted
    slot: the steady state of a full tier), then, the page cache dropped, to
    load them all back (checksums checked)."""
    shutil.rmtree(root, ignore_errors=True)
    bs, n = pool.chunk_bytes, pool.num_chunks
    ns = Namespace(model="bench", chunk_bytes=bs)
    tier = StorageTier(str(root), n * bs, bs, ns, io_threads=io_threads, num_files=num_files)
    mgr, worker = tier.get_manager(), tier.get_worker(pool)
    ctx = ReqContext("bench")
    keys = [make_offload_key(i.to_bytes(8, "big"), 0) for i in range(n)]
    again = [make_offload_key(i.to_bytes(8, "big"), 1) for i in range(n)]
    try:
        t = time.perf_counter()
        _jobs(mgr, worker, keys, batch, ctx, 0, True)
        assert tier.store.flush()  # the group commit: slabs fdatasync'd, index appended and fdatasync'd
        write_s = time.perf_counter() - t
        t = time.perf_counter()
        _jobs(mgr, worker, again, batch, ctx, 1 << 20, True)
        assert tier.store.flush()
        overwrite_s = time.perf_counter() - t
        drop_caches()
        read_s = _jobs(mgr, worker, again, batch, ctx, 2 << 20, False)
    finally:
        worker.shutdown()
        mgr.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    return write_s, overwrite_s, read_s


def vllm_fs_write_read(python: str, root: Path, bs: int, n: int, batch: int) -> tuple[float, float]:
    """vLLM 0.33's filesystem tier, in its own venv's python (storage_vllm_fs.py)."""
    shutil.rmtree(root, ignore_errors=True)
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    env.pop("PYTHONPATH", None)
    try:
        out = subprocess.run([python, str(VLLM_DRIVER), "--dir", str(root), "--chunk-bytes", str(bs),
                              "--chunks", str(n), "--batch", str(batch), "--drop-caches"],
                             capture_output=True, text=True, env=env, cwd="/", check=False)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if out.returncode != 0:
        raise SystemExit(f"vLLM fs tier run failed:\n{out.stderr[-2000:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return r["write_s"], r["read_s"]


def run_io(args) -> dict:
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    sizes = [(bs, (args.small_total_mib if bs < (64 << 10) else args.total_mib) << 20) for bs in args.chunk_sizes]
    bar = tqdm(total=len(sizes) * args.repeats, desc="storage io", disable=args.no_progress)
    for bs, total in sizes:
        n = total // bs
        batch = max(1, args.job_bytes // bs)
        pool = HostPool(n, bs)
        pool.array[:] = np.random.default_rng(0).integers(0, 256, pool.array.shape[1], dtype=np.uint8)
        t = {k: [] for k in ("ddw", "ddr", "tw", "tow", "tr", "vw", "vr")}
        for _ in range(args.repeats):  # interleaved, so drift hits all alike
            w, r = dd_write_read(root / "dd.bin", bs, n)
            t["ddw"].append(w)
            t["ddr"].append(r)
            w, ow, r = tier_write_read(root / "tier", pool, batch, args.io_threads, args.num_files)
            t["tw"].append(w)
            t["tow"].append(ow)
            t["tr"].append(r)
            if args.vllm_python:
                w, r = vllm_fs_write_read(args.vllm_python, root / "vllm-fs", bs, n, batch)
                t["vw"].append(w)
                t["vr"].append(r)
            bar.update()
        pool.close()
        gb = n * bs / 1e9
        rate = {k: gb / statistics.median(v) if v else float("nan") for k, v in t.items()}
        rows.append({"chunk_bytes": bs, "total_bytes": n * bs, "job_chunks": batch,
                     **{f"{k}_GBps": v for k, v in rate.items()},
                     "write_vs_dd": rate["tw"] / rate["ddw"], "overwrite_vs_dd": rate["tow"] / rate["ddw"],
                     "read_vs_dd": rate["tr"] / rate["ddr"],
                     "write_vs_vllm": rate["tw"] / rate["vw"], "read_vs_vllm": rate["tr"] / rate["vr"],
                     "seconds": t})
    bar.close()
    print(f"GB/s, median of {args.repeats}; ours = kvoffload storage tier (store: fresh slabs + index commit; "
          "overwrite: a full tier's steady state); page cache dropped before every read")
    print(f"{'chunk':>7} | {'dd':>5} {'vllm':>5} {'ours':>5} {'ovw':>5} {'/dd':>5} {'/vllm':>6} | "
          f"{'dd':>5} {'vllm':>5} {'ours':>5} {'/dd':>5} {'/vllm':>6}")
    print(f"{'':>7} | {'store':^37} | {'load':^31}")
    for r in rows:
        print(f"{r['chunk_bytes'] >> 10:>5}Ki | {r['ddw_GBps']:>5.2f} {r['vw_GBps']:>5.2f} {r['tw_GBps']:>5.2f} "
              f"{r['tow_GBps']:>5.2f} {r['write_vs_dd']:>5.2f} {r['write_vs_vllm']:>6.2f} | "
              f"{r['ddr_GBps']:>5.2f} {r['vr_GBps']:>5.2f} {r['tr_GBps']:>5.2f} {r['read_vs_dd']:>5.2f} "
              f"{r['read_vs_vllm']:>6.2f}")
    return {"io": rows, "io_threads": args.io_threads, "num_files": args.num_files, "job_bytes": args.job_bytes}


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
            bars = [("ddw_GBps", "dd store"), ("vw_GBps", "vLLM fs store"), ("tw_GBps", "ours store"),
                    ("ddr_GBps", "dd load"), ("vr_GBps", "vLLM fs load"), ("tr_GBps", "ours load")]
            for off, (key, label) in enumerate(bars):
                ax.bar(x + (off - 2.5) * 0.14, [r[key] for r in result["io"]], 0.14, label=label)
            ax.set_xticks(x, [f"{r['chunk_bytes'] >> 10} KiB" for r in result["io"]])
            ax.set_ylabel("GB/s (O_DIRECT)")
            ax.set_title("storage tier vs dd O_DIRECT and vLLM's fs tier")
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
    p.add_argument("--total-mib", type=int, default=1024, help="bytes per measured write/read, MiB")
    p.add_argument("--small-total-mib", type=int, default=256, help="the same for chunks under 64 KiB")
    p.add_argument("--chunk-sizes", type=lambda s: [int(x) for x in s.split(",")], default=list(CHUNK_SIZES))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--job-bytes", type=int, default=4 << 20, help="bytes per store/load job (io)")
    p.add_argument("--vllm-python", help="python of a vLLM 0.33 venv: its filesystem tier is measured too")
    p.add_argument("--batch", type=int, default=16, help="chunks per store/load job (paced)")
    p.add_argument("--io-threads", type=int, default=16)
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
