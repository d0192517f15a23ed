"""The storage index over a long run: size of index.log and the time and
memory to open it after an hour-equivalent stream of stores.

A full tier at 1,000 chunks/s for an hour is 3.6M stores; each overwrites a
slot and appends one PUT (a reused slot gets no FREE), here one group commit
per job (16 chunks: more commits, so more compaction checks, than the
engine's timer makes). The stream goes through SlabStore.record_stored and
flush, the API the worker and the commit thread call, so compaction runs
exactly as in the engine; no chunk bytes are written (the index does not
read them). By default the fsyncs are skipped (--sync keeps
them), which changes the stream's speed, not the log's size or the open.

    .venv/bin/python benchmarks/bench_storage_index.py --dir /tmp/kvbench-index
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
import tracemalloc
from pathlib import Path

from kvoffload.tiers.base import Namespace
from kvoffload.tiers.storage.index import RECORD_BYTES, IndexLog
from kvoffload.tiers.storage.store import SlabStore

SLOT = 4096  # the index does not care; small slots keep the slab files small


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/kvbench-index"))
    ap.add_argument("--stores", type=int, default=3_600_000, help="chunks stored (1 h at 1,000/s)")
    ap.add_argument("--slots", type=int, default=32_768, help="tier capacity in chunks (64 GiB of 2 MiB)")
    ap.add_argument("--job", type=int, default=16, help="chunks per store job (one group commit)")
    ap.add_argument("--sync", action="store_true", help="keep the fsyncs (much slower)")
    ap.add_argument("--out", type=Path, default=Path("out/bench_storage/index.json"))
    args = ap.parse_args()

    shutil.rmtree(args.dir, ignore_errors=True)
    if not args.sync:
        os.fdatasync = os.fsync = lambda fd: None  # noqa: E731 (the stream's speed is not the figure)
    ns = Namespace(model="bench", chunk_bytes=SLOT)
    store = SlabStore(args.dir, ns, SLOT, args.slots, direct_io=False, commit_interval_s=3600)
    store.allocate()
    log = store.dir / IndexLog.NAME
    rewrites = 0
    rewrite = store.index.rewrite

    def counting(entries):
        nonlocal rewrites
        rewrites += 1
        rewrite(entries)

    store.index.rewrite = counting
    peak_records = 0
    t0 = time.perf_counter()
    for b in range(0, args.stores, args.job):
        n = min(args.job, args.stores - b)
        slots = [(b + j) % args.slots for j in range(n)]
        store.record_stored([(s, (b + j).to_bytes(16, "little"), b + j) for j, s in enumerate(slots)])
        assert store.flush()
        peak_records = max(peak_records, store.index.records)
    stream_s = time.perf_counter() - t0
    live = len(store.durable)
    store.close()
    size = log.stat().st_size

    opens, peaks = [], []
    for _ in range(3):
        tracemalloc.start()
        t = time.perf_counter()
        s = SlabStore(args.dir, ns, SLOT, args.slots, direct_io=False)
        opens.append(time.perf_counter() - t)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        assert len(s.durable) == live and s.bad_index_records == 0
        s.close()
    t = time.perf_counter()  # the same open without tracemalloc's overhead
    SlabStore(args.dir, ns, SLOT, args.slots, direct_io=False).close()
    open_plain = time.perf_counter() - t

    result = {
        "stores": args.stores, "slots": args.slots, "job": args.job, "synced": args.sync,
        "live_entries": live, "live_index_bytes": live * RECORD_BYTES,
        "index_bytes_end": size, "index_bytes_peak": peak_records * RECORD_BYTES,
        "uncompacted_bytes": (1 + args.stores) * RECORD_BYTES, "compactions": rewrites,
        "stream_s": round(stream_s, 2), "open_s_median_traced": round(statistics.median(opens), 3),
        "open_s": round(open_plain, 3), "open_peak_python_bytes": max(peaks),
    }
    print(json.dumps(result, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
