"""Storage tier, one store job at a time: what an engine that waits for
each store sees (the replay's engine, a slow scheduler step). Per-job
latency and GB/s of 4 MiB store jobs into fresh slabs and into a full tier
(every store overwrites an evicted slot), against dd O_DIRECT writing the
same bytes 4 MiB at a time (queue depth 1) in the same run.

    .venv/bin/python benchmarks/bench_storage_latency.py --dir /tmp/kvbench

Before the index's group commit, a job waited for an fdatasync of its slabs
and one of the index (plus a FREE round before overwriting a slot); now it
waits for its writes only.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np

from kvoffload.abstractions import CPULoadStoreSpec, ReqContext
from kvoffload.keys import make_offload_key
from kvoffload.tiers.base import Namespace
from kvoffload.tiers.host_pool import HostPool
from kvoffload.tiers.storage.tier import StorageTier

JOB = 4 << 20


def serial_stores(mgr, worker, keys, batch, first) -> tuple[float, float]:
    """(seconds for all, median seconds per job), one job in flight at a time."""
    ctx, lat, t0 = ReqContext("bench"), [], time.perf_counter()
    for j, lo in enumerate(range(0, len(keys), batch), first):
        ks = keys[lo : lo + batch]
        out = mgr.prepare_store(ks, ctx)
        t = time.perf_counter()
        worker.submit_store(j, CPULoadStoreSpec(range(lo, lo + len(ks))), out.store_spec)
        worker.wait({j})
        lat.append(time.perf_counter() - t)
        (r,) = worker.get_finished()
        assert r.success, "store failed"
        mgr.complete_store(ks, ctx)
    return time.perf_counter() - t0, statistics.median(lat)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=Path("/tmp/kvoffload-bench-storage"))
    p.add_argument("--total-mib", type=int, default=256)
    p.add_argument("--chunk-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[256 << 10, 2 << 20])
    args = p.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    print(f"{'chunk':>7} | {'dd 4MiB QD1':>11} | {'fresh':>6} {'job ms':>6} {'/dd':>5} | {'full':>6} {'job ms':>6} {'/dd':>5}")
    for bs in args.chunk_sizes:
        n = (args.total_mib << 20) // bs
        f = args.dir / "dd.bin"
        f.unlink(missing_ok=True)
        t = time.perf_counter()
        subprocess.run(["dd", "if=/dev/zero", f"of={f}", f"bs={JOB}", f"count={n * bs // JOB}", "oflag=direct",
                        "status=none"], check=True)
        dd = n * bs / 1e9 / (time.perf_counter() - t)
        f.unlink()
        pool = HostPool(n, bs)
        pool.array[:] = np.random.default_rng(0).integers(0, 256, pool.array.shape[1], dtype=np.uint8)
        root = args.dir / "tier"
        shutil.rmtree(root, ignore_errors=True)
        tier = StorageTier(str(root), n * bs, bs, Namespace(model="bench", chunk_bytes=bs))
        mgr, worker = tier.get_manager(), tier.get_worker(pool)
        batch = max(1, JOB // bs)
        try:
            fresh = serial_stores(mgr, worker, [make_offload_key(i.to_bytes(8, "big"), 0) for i in range(n)], batch, 0)
            full = serial_stores(mgr, worker, [make_offload_key(i.to_bytes(8, "big"), 1) for i in range(n)], batch,
                                 1 << 20)
        finally:
            worker.shutdown()
            mgr.shutdown()
            pool.close()
            shutil.rmtree(root, ignore_errors=True)
        gb = n * bs / 1e9
        print(f"{bs >> 10:>5}Ki | {dd:>11.2f} | {gb / fresh[0]:>6.2f} {fresh[1] * 1e3:>6.1f} {gb / fresh[0] / dd:>5.2f} | "
              f"{gb / full[0]:>6.2f} {full[1] * 1e3:>6.1f} {gb / full[0] / dd:>5.2f}")


if __name__ == "__main__":
    main()
