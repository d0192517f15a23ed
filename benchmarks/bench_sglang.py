"""What the SGLang HiCache backend costs over the tier it wraps.

For each tier (storage on a temp dir, Redis on a local redis-server), in
one run: GB/s of the backend's zero-copy calls (batch_set_v1 /
batch_get_v1 between an SGLang host pool and the tier) against the tier
alone moving the same pages from and to its staging slots (the same
manager/worker calls and jobs, without SGLang's page copies and key handling).
Ratio = backend / tier alone (1.0: the wrapping is free). Then the
storage-tier backend against SGLang's own file backend (HiCacheFile) on the
same pages, reads cold for both (O_DIRECT here; fadvise DONTNEED there).

    PYTHONPATH=src python benchmarks/bench_sglang.py [--pages 64] [--reps 5]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "integrations" / "sglang"))
from sglang_pool import SGLangMHAHostPool  # noqa: E402

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from kvoffload.integrations.sglang.pages import key_bytes  # noqa: E402
from kvoffload.tiers.redis.server import LocalServer  # noqa: E402

PAGE = 64  # tokens


def make(section: dict, pages: int, layers: int):
    extra = {"backend_name": "kvoffload", "module_path": "kvoffload.integrations.sglang.backend",
             "class_name": "KvoffloadHiCacheStorage", "interface_v1": 1,
             "kvoffload": {"staging_bytes": "1GiB", **section}}
    cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                               is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                               model_name="bench", extra_config=extra)
    pool = SGLangMHAHostPool(size=2 * pages * PAGE, page_size=PAGE, layer_num=layers, head_num=8, head_dim=128)
    pool.fill_random(0)
    backend = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    backend.register_mem_pool_host(pool)
    return backend, pool


def keys(n: int, salt: str) -> list[str]:
    return [hashlib.sha256(f"{salt}-{i}".encode()).hexdigest() for i in range(n)]


def timed(fn) -> float:
    t = time.perf_counter()
    assert fn(), "transfer failed"
    return time.perf_counter() - t


def tier_alone(io, parts, kb, store: bool) -> bool:
    """The tier moving the staging slots, in the backend's jobs, all in flight at once."""
    start = io.start_store if store else io.start_load
    jobs = [start(kb[p.start : p.stop], slots) for p, slots in parts]
    return all([io.finish(j) for j in jobs])


def run(name: str, section: dict, n: int, reps: int, layers: int) -> None:
    backend, pool = make(section, n, layers)
    io, half, nbytes = backend.io, backend._half, n * backend.format.page_bytes
    if n > half:
        raise SystemExit(f"--pages {n} is more than the {half} staging slots")
    idx = torch.arange(n * PAGE)
    back = torch.arange(n * PAGE, 2 * n * PAGE)
    parts = list(backend._parts(range(n), store=True))  # the same jobs the backend makes
    res = {k: [] for k in ("set", "set_ref", "get", "get_ref")}
    try:
        for r in range(reps):  # interleaved, so drift hits both alike
            ks = keys(n, f"{name}-b{r}")
            res["set"].append(timed(lambda: all(backend.batch_set_v1(ks, idx))))
            res["get"].append(timed(lambda: all(backend.batch_get_v1(ks, back))))
            kb = [key_bytes(k) for k in keys(n, f"{name}-t{r}")]
            res["set_ref"].append(timed(lambda: tier_alone(io, parts, kb, store=True)))
            res["get_ref"].append(timed(lambda: tier_alone(io, parts, kb, store=False)))
        raw = pool.kv_buffer.view(torch.int16)  # bytes, not values: random bf16 holds NaNs
        assert torch.equal(raw[:, : n * PAGE], raw[:, n * PAGE : 2 * n * PAGE]), "pages came back different"
    finally:
        backend.close()
    gbs = {k: nbytes / statistics.median(v) / 1e9 for k, v in res.items()}
    print(f"| {name} | {backend.format.page_bytes >> 10} KiB x {n} | {gbs['set']:.2f} | {gbs['set_ref']:.2f} | "
          f"{gbs['set'] / gbs['set_ref']:.2f} | {gbs['get']:.2f} | {gbs['get_ref']:.2f} | "
          f"{gbs['get'] / gbs['get_ref']:.2f} |")


def uncache(directory: str) -> None:
    """Drop these files' pages from the page cache (only theirs: the machine is shared)."""
    for name in os.listdir(directory):
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def run_vs_file(n: int, reps: int, layers: int) -> None:
    """Against SGLang's own file backend (HiCacheFile), driven as SGLang's cache controller drives it
    (generic path: flat data pages out, dummy pages in, then set_from_flat_data_page), cold reads both."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    with tempfile.TemporaryDirectory() as ours_dir, tempfile.TemporaryDirectory() as file_dir:
        cap = 2 * reps * n * (2 * PAGE * layers * 8 * 128 * 2)
        backend, pool = make({"type": "storage", "path": ours_dir, "capacity_bytes": cap}, n, layers)
        cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                   is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                                   model_name="bench", extra_config={"file_storage_path": file_dir})
        hf = HiCacheFile(cfg)
        idx, back = torch.arange(n * PAGE), torch.arange(n * PAGE, 2 * n * PAGE)
        res = {k: [] for k in ("set", "file_set", "get", "file_get")}

        def file_get(ks):
            got = hf.batch_get(ks, [pool.get_dummy_flat_data_page() for _ in ks])
            for i, page in enumerate(got):
                pool.set_from_flat_data_page((n + i) * PAGE, page)
            return all(g is not None for g in got)

        try:
            for r in range(reps):
                ks = keys(n, f"vs-file-b{r}")
                res["set"].append(timed(lambda: all(backend.batch_set_v1(ks, idx))))
                res["get"].append(timed(lambda: all(backend.batch_get_v1(ks, back))))
                fk = keys(n, f"vs-file-f{r}")
                res["file_set"].append(timed(lambda: hf.batch_set(fk, [pool.get_data_page(i * PAGE) for i in range(n)])))
                uncache(file_dir)
                res["file_get"].append(timed(lambda: file_get(fk)))
        finally:
            backend.close()
        nbytes = n * backend.format.page_bytes
        gbs = {k: nbytes / statistics.median(v) / 1e9 for k, v in res.items()}
        print(f"| set | {gbs['set']:.2f} | {gbs['file_set']:.2f} | {gbs['set'] / gbs['file_set']:.2f} |")
        print(f"| get (cold) | {gbs['get']:.2f} | {gbs['file_get']:.2f} | {gbs['get'] / gbs['file_get']:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=4, help="page bytes = 2 x 64 tokens x layers x 8 x 128 x 2")
    a = ap.parse_args()
    print("| tier | pages | set GB/s | tier alone | ratio | get GB/s | tier alone | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as d:
        cap = 4 * a.reps * a.pages * (2 * PAGE * a.layers * 8 * 128 * 2)
        run("storage", {"type": "storage", "path": d, "capacity_bytes": cap}, a.pages, a.reps, a.layers)
    srv = LocalServer(maxmemory="2gb", unix_socket=True).start()
    try:
        run("redis", {"type": "redis", "url": srv.unix_url, "lookup_deadline_s": 30.0}, a.pages, a.reps, a.layers)
    finally:
        srv.close()
    print()
    print("| vs SGLang's HiCacheFile | kvoffload storage tier GB/s | HiCacheFile GB/s | ratio |")
    print("|---|---|---|---|")
    run_vs_file(a.pages, a.reps, a.layers)


if __name__ == "__main__":
    main()
