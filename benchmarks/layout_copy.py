"""Copy speed into canonical pages vs a plain page copy of the same bytes.

One TP rank's pages of a Llama-like layer (16 tokens, 8 KV heads of 128,
bf16) are copied into canonical (TP=1) pages. Reference, in the same run: a
plain contiguous copy of the same number of bytes (what an unmapped page
costs). Compared: store_pages batched (one strided copy per run; the
reference copier of tests/layout/layout_ref.py),
store_pages per block, and ctypes.memmove per fragment (the worker's path).
Second table: CPUOffloadingWorker store and load jobs through those
mappings, against the same worker moving unmapped pages of the same size,
with GPU block ids and pool slots either reversed (one stretch per job) or
both shuffled (the worker's worst case: a stretch per two blocks).

    .venv/bin/python benchmarks/layout_copy.py
"""

from __future__ import annotations

import ctypes
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from kvoffload.abstractions import CPULoadStoreSpec, GPULoadStoreSpec
from kvoffload.config import OffloadingConfig
from kvoffload.kv_caches import make_kv_caches
from kvoffload.layout import LayerLayout, ParallelLayout, try_layer_mapping
from kvoffload.tiers.cpu.worker import CPUOffloadingWorker

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "layout"))
from layout_ref import store_pages  # noqa: E402  (a test helper: no caller in the package)

NUM_BLOCKS = 1024  # 32 MiB of local pages at TP=2: beyond the caches
REPEATS = 15


def timed(fn) -> float:
    fn()  # warm up
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def case(order: str, tp: int) -> dict[str, float]:
    layer = LayerLayout(16, 8, 128, torch.bfloat16, order=order)
    m = try_layer_mapping(layer, ParallelLayout(0, tp))
    local = torch.randint(0, 256, (NUM_BLOCKS, m.local_page_size_bytes), dtype=torch.uint8)
    canon = torch.zeros(NUM_BLOCKS, m.canonical_page_size_bytes, dtype=torch.uint8)
    plain_dst = torch.zeros_like(local)
    nbytes = local.numel()
    run = m.runs[0]
    frags = [(canon.data_ptr() + b * canon.stride(0) + run.canonical_offset + i * run.canonical_stride,
              local.data_ptr() + b * local.stride(0) + run.local_offset + i * run.local_stride)
             for b in range(NUM_BLOCKS) for i in range(run.num_fragments)]

    def memmove_fragments():
        mv, n = ctypes.memmove, run.fragment_size
        for dst, src in frags:
            mv(dst, src, n)

    def per_block():
        for b in range(NUM_BLOCKS):
            store_pages(m, local[b:b + 1], canon[b:b + 1])

    t_ref = timed(lambda: plain_dst.copy_(local))
    out = {"fragment_B": run.fragment_size, "plain_GBps": nbytes / t_ref / 1e9}
    for name, fn in (("batched", lambda: store_pages(m, local, canon)), ("per_block", per_block),
                     ("memmove_frag", memmove_fragments)):
        t = timed(fn)
        out[f"{name}_GBps"] = nbytes / t / 1e9
        out[f"{name}_ratio"] = t_ref / t
    return out


def paired(fns) -> list[float]:
    """Median seconds of each fn, timed in turns (so a noisy neighbour hits all alike)."""
    for fn in fns:
        fn()  # warm up
    times = [[] for _ in fns]
    for _ in range(REPEATS):
        for t, fn in zip(times, fns):
            t0 = time.perf_counter()
            fn()
            t.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def worker_jobs(mapping, local: torch.Tensor, gpu_ids: list[int], slots: list[int]):
    """A worker over `local` and its store / load job of every block."""
    kv = make_kv_caches([local])
    kv.group_data_refs[0][0].mapping = mapping
    w = CPUOffloadingWorker(kv, OffloadingConfig.from_dict({"groups": [16]}), local.shape[0])
    job = iter(range(1 << 30))

    def go(direction):
        j = next(job)
        if direction == "store":
            ok = w.submit_store(j, GPULoadStoreSpec(gpu_ids), CPULoadStoreSpec(slots))
        else:
            ok = w.submit_load(j, CPULoadStoreSpec(slots), GPULoadStoreSpec(gpu_ids))
        assert ok, w.last_error
        w.wait({j})
        assert all(r.success for r in w.get_finished())

    return w, (lambda: go("store")), (lambda: go("load"))


def worker_case(order: str, tp: int, ids: str) -> dict[str, float]:
    layer = LayerLayout(16, 8, 128, torch.bfloat16, order=order)
    m = try_layer_mapping(layer, ParallelLayout(0, tp))
    local = torch.randint(0, 256, (NUM_BLOCKS, m.local_page_size_bytes), dtype=torch.uint8)
    if ids == "reversed":  # GPU ids count down, slots up: one stretch per job
        gpu_ids, slots = list(range(NUM_BLOCKS))[::-1], list(range(NUM_BLOCKS))
    else:  # both shuffled: stretches of two blocks, the worst case
        g = torch.Generator().manual_seed(1)
        gpu_ids, slots = torch.randperm(NUM_BLOCKS, generator=g).tolist(), torch.randperm(NUM_BLOCKS, generator=g).tolist()
    ref_w, ref_store, ref_load = worker_jobs(None, local, gpu_ids, slots)
    w, store, load = worker_jobs(m, local, gpu_ids, slots)
    try:
        times = dict(zip(("ref_store", "store", "ref_load", "load"), paired([ref_store, store, ref_load, load])))
    finally:
        ref_w.shutdown()
        w.shutdown()
    n = local.numel()
    return {f"{d}_{k}": v for d in ("store", "load")
            for k, v in (("ref_GBps", n / times["ref_" + d] / 1e9), ("GBps", n / times[d] / 1e9),
                         ("ratio", times["ref_" + d] / times[d]))}


def main() -> None:
    torch.set_num_threads(1)
    cases = [(o, tp) for o in ("NHD", "HND") for tp in (2, 8)]
    rows = [(o, tp, case(o, tp)) for o, tp in tqdm(cases, desc="layouts")]
    print(f"{NUM_BLOCKS} blocks of one rank's pages, median of {REPEATS}; ratio = plain copy time / this time")
    print(f"{'order':5} {'tp':>3} {'frag B':>7} {'plain GB/s':>10} {'batched':>15} {'per block':>15} {'memmove/frag':>15}")
    for o, tp, r in rows:
        cells = [f"{r[k + '_GBps']:5.1f} ({r[k + '_ratio']:.2f}x)" for k in ("batched", "per_block", "memmove_frag")]
        print(f"{o:5} {tp:>3} {r['fragment_B']:>7} {r['plain_GBps']:>10.1f} " + " ".join(f"{c:>15}" for c in cells))
    wcases = [(o, tp, ids) for o, tp in cases for ids in ("reversed", "shuffled")]
    wrows = [(o, tp, ids, worker_case(o, tp, ids)) for o, tp, ids in tqdm(wcases, desc="worker")]
    print("CPU worker job of all blocks (store, then load); ratio = unmapped time / mapped time")
    print(f"{'order':5} {'tp':>3} {'ids':8} {'store unmapped':>14} {'mapped':>6} {'ratio':>6}"
          f" {'load unmapped':>13} {'mapped':>6} {'ratio':>6}")
    for o, tp, ids, r in wrows:
        print(f"{o:5} {tp:>3} {ids:8} " + " ".join(
            f"{r[d + '_ref_GBps']:>{w}.1f} {r[d + '_GBps']:>6.1f} {r[d + '_ratio']:>5.2f}x"
            for d, w in (("store", 14), ("load", 13))))

if __name__ == "__main__":
    main()
