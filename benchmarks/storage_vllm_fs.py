"""Drives vLLM 0.33's own filesystem tier (vllm/v1/kv_offload/tiering/fs,
FileSystemTierManager) through its manager API: submit_store / submit_load
of TransferJobs over a CPU KV view, get_finished_jobs polled until done.
Run by bench_storage.py with a vLLM 0.33 venv's python (vLLM is not a
dependency of kvoffload); prints one JSON line of seconds.

    VENV/bin/python benchmarks/storage_vllm_fs.py --dir D --chunk-bytes B --chunks N --batch K

The offloading spec is reduced to the fields the tier reads (the file
mapper's model/parallel/cache fields, blocks_per_chunk, kv events off).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np


def _spec(block_size_tokens: int = 16) -> SimpleNamespace:
    group = SimpleNamespace(tokens_per_block=block_size_tokens, layer_names=["layer.0"])
    parallel = SimpleNamespace(tp_size=1, pp_size=1, pcp_size=1, dcp_size=1, rank=0,
                               is_parallelism_agnostic=True)
    config = SimpleNamespace(groups=[group], parallel=parallel, canonical_layout=False, kv_cache_layout=None,
                             replicated_layout=False, cache=SimpleNamespace(tokens_per_hash=block_size_tokens),
                             model=SimpleNamespace(name="bench", dtype="float16"))
    return SimpleNamespace(config=config, blocks_per_chunk=1,
                           kv_events_config=SimpleNamespace(enable_kv_cache_events=False))


def _run(tier, jobs, submit) -> float:
    t = time.perf_counter()
    for job in jobs:
        submit(job)
    done, ok = 0, True
    while done < len(jobs):
        for r in tier.get_finished_jobs():
            done += 1
            ok &= r.success
        time.sleep(0.0005)
    seconds = time.perf_counter() - t
    if not ok:
        raise SystemExit("vLLM fs tier: a job failed")
    return seconds


def main() -> None:
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key
    from vllm.v1.kv_offload.tiering.base import TransferJob
    from vllm.v1.kv_offload.tiering.fs import io as fs_io
    from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--chunk-bytes", type=int, required=True)
    p.add_argument("--chunks", type=int, required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--drop-caches", action="store_true")
    args = p.parse_args()
    bs, n = args.chunk_bytes, args.chunks
    buf = mmap.mmap(-1, n * bs)  # page-aligned, as its O_DIRECT path needs
    arr = np.frombuffer(buf, dtype=np.uint8).reshape(n, bs)
    arr[:] = np.random.default_rng(0).integers(0, 256, bs, dtype=np.uint8)
    tier = FileSystemTierManager(_spec(), memoryview(arr), "fs", args.dir)
    ctx = ReqContext("bench")
    keys = [make_offload_key(i.to_bytes(16, "big"), 0) for i in range(n)]
    batches = [list(range(lo, min(n, lo + args.batch))) for lo in range(0, n, args.batch)]

    def job(j, ids):
        return TransferJob(j, [keys[i] for i in ids], np.array(ids, dtype=np.int64), False, ctx)

    try:
        write_s = _run(tier, [job(j, ids) for j, ids in enumerate(batches)], tier.submit_store)
        if args.drop_caches:
            os.sync()
            subprocess.run(["sh", "-c", "echo 3 > /proc/sys/vm/drop_caches"], check=True)
        arr[:] = 0
        read_s = _run(tier, [job(len(batches) + j, ids) for j, ids in enumerate(batches)], tier.submit_load)
        if not (arr[-1] == np.random.default_rng(0).integers(0, 256, bs, dtype=np.uint8)).all():
            raise SystemExit("vLLM fs tier: loaded bytes differ")
    finally:
        tier.shutdown()
    print(json.dumps({"write_s": write_s, "read_s": read_s, "o_direct": tier._use_o_direct,
                      "c_extension": bool(fs_io._HAS_FSIO_C)}))


if __name__ == "__main__":
    sys.exit(main())
