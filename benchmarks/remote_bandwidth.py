"""Part 1 of bench_remote.py: the Redis tier's worker storing / loading
host-pool chunks against redis-benchmark SET / GET and redis-py pipelines
with the same value size, connections and pipeline depth, on the same
server in the same run."""

from __future__ import annotations

import statistics
import subprocess
import time

import numpy as np
import redis

from kvoffload.tiers.base import Namespace
from kvoffload.tiers.host_pool import HostPool
from kvoffload.tiers.redis import RemoteTier
from kvoffload.tiers.redis.server import LocalServer, find_benchmark_binary
from mooncake_bandwidth import ours as time_jobs  # one worker, jobs submitted at once


def redis_benchmark(port: int, size: int, n: int, pipeline: int, clients: int = 1,
                    values: HostPool | None = None) -> dict[str, float]:
    """GB/s of redis-benchmark SET and GET with `size`-byte values over
    `clients` connections, `pipeline` commands per round each.

    GET is credited only with the bytes it moved: `-r n` picks random keys,
    and the SET run before it (also `-r n`) leaves only ~63% of the n keys
    set, so ~37% of a plain `-t set,get` run's GETs answer nil (5 bytes) yet
    would count as `size` bytes each (the reference this replaced, ~1.6x
    too high). All n keys (key:000000000000 ...) are set first, untimed,
    from `values`, and the server's keyspace hits / misses during the GET
    run give the share of GETs that returned a value (1.0 expected)."""
    base = [find_benchmark_binary(), "-h", "127.0.0.1", "-p", str(port), "-d", str(size), "-n", str(n),
            "-r", str(n), "-c", str(clients), "-P", str(pipeline), "--csv"]

    def rps(test: str) -> float:
        out = subprocess.run(base + ["-t", test], capture_output=True, text=True, check=True, timeout=600).stdout
        for line in out.splitlines():
            cells = [c.strip('"') for c in line.split(",")]
            if cells[0] == test.upper():
                return float(cells[1])
        raise RuntimeError(f"redis-benchmark printed no {test.upper()} line: {out[-300:]!r}")

    gbs = {"SET": rps("set") * size / 1e9}
    r = redis.Redis(port=port)
    for a in range(0, n, 64):
        p = r.pipeline(transaction=False)
        for i in range(a, min(n, a + 64)):
            p.set(b"key:%012d" % i, values.chunk_memoryview(i % values.array.shape[0])[:size] if values else
                  b"x" * size)
        p.execute()
    before = r.info("stats")
    get_rps = rps("get")
    after = r.info("stats")
    hits = after["keyspace_hits"] - before["keyspace_hits"]
    misses = after["keyspace_misses"] - before["keyspace_misses"]
    gbs["hit_share"] = hits / max(1, hits + misses)
    gbs["GET"] = get_rps * gbs["hit_share"] * size / 1e9
    r.close()
    return gbs


def ours(url: str, pool: HostPool, n: int, batch_chunks: int, one_load: bool = False, **tier_conf) -> dict[str, float]:
    """GB/s of our worker storing then loading n chunks (jobs of batch_chunks;
    one_load: the load is one job of all n chunks)."""
    ns = Namespace(model="bench", chunk_bytes=pool.used_chunk_bytes)
    tier = RemoteTier({"url": url, "key_prefix": f"bench{time.monotonic_ns()}", **tier_conf}, ns)
    return drive(tier, pool, n, batch_chunks, load_chunks=n if one_load else None)


def drive(tier, pool: HostPool, n: int, batch_chunks: int, shutdown: bool = True,
          load_chunks: int | None = None) -> dict[str, float]:
    """GB/s of a remote-kind tier's worker storing then loading n chunks (jobs
    of batch_chunks; loads in jobs of load_chunks if given)."""
    worker = tier.get_worker(pool)
    keys = [i.to_bytes(8, "big") + b"\0\0\0\0" for i in range(n)]
    rkeys = tier.keyspace.redis_keys(keys)
    res = {}
    for name, op in (("store", "put"), ("load", "get")):
        per_job = batch_chunks if name == "store" or not load_chunks else load_chunks
        res[name] = n * pool.used_chunk_bytes / time_jobs(worker, op, rkeys, keys, range(n), per_job) / 1e9
    if shutdown:
        tier.shutdown()
    return res


def redis_py(url: str, pool: HostPool, n: int, batch_chunks: int) -> dict[str, float]:
    """GB/s of plain redis-py pipelines (values copied into bytes on both sides)."""
    r = redis.Redis.from_url(url)
    keys = [b"rpy:%d" % i for i in range(n)]
    res = {}
    t0 = time.perf_counter()
    for a in range(0, n, batch_chunks):
        p = r.pipeline(transaction=False)
        for i in range(a, min(n, a + batch_chunks)):
            p.set(keys[i], pool.chunk(i)[: pool.used_chunk_bytes].tobytes())
        p.execute()
    res["SET"] = n * pool.used_chunk_bytes / (time.perf_counter() - t0) / 1e9
    t0 = time.perf_counter()
    for a in range(0, n, batch_chunks):
        p = r.pipeline(transaction=False)
        for i in range(a, min(n, a + batch_chunks)):
            p.get(keys[i])
        for i, v in zip(range(a, n), p.execute()):
            pool.chunk(i)[: len(v)] = np.frombuffer(v, dtype=np.uint8)
    res["GET"] = n * pool.used_chunk_bytes / (time.perf_counter() - t0) / 1e9
    r.close()
    return res


def bandwidth(srv: LocalServer, sizes: list[int], total: int, repeats: int, pipeline: int,
              connections: list[int]) -> list[dict]:
    """Per value size and connection count c: redis-benchmark -c c -P pipeline
    against our worker with io_threads c and batch_bytes pipeline x size (at
    most `pipeline` commands outstanding per connection, both sides)."""
    from tqdm import tqdm

    rows = []
    flush = redis.Redis(port=srv.port)
    bar = tqdm(total=len(sizes) * len(connections) * repeats, desc="bandwidth", unit="run")
    for size in sizes:
        n = max(pipeline * max(connections), total // size)
        pool = HostPool(n, size)
        pool.array[:] = np.random.default_rng(size).integers(0, 256, pool.array.shape, dtype=np.uint8)
        before = pool.array.copy()
        for c in connections:
            conf = {"io_threads": c, "batch_bytes": pipeline * size}
            runs = {k: [] for k in ("rb_set", "rb_get", "hit_share", "store", "load", "one_load", "py_set", "py_get")}
            for _ in range(repeats):
                flush.flushall()
                rb = redis_benchmark(srv.port, size, n, pipeline, c, pool)
                flush.flushall()
                o = ours(srv.url, pool, n, pipeline, **conf)
                assert np.array_equal(pool.array, before), "loaded bytes differ"
                flush.flushall()
                one = ours(srv.url, pool, n, pipeline, one_load=True, **conf)
                assert np.array_equal(pool.array, before), "loaded bytes differ"
                flush.flushall()
                py = redis_py(srv.url, pool, n, pipeline) if c == 1 else {"SET": float("nan"), "GET": float("nan")}
                pool.array[:] = before
                for k, v in (("rb_set", rb["SET"]), ("rb_get", rb["GET"]), ("hit_share", rb["hit_share"]),
                             ("store", o["store"]), ("load", o["load"]), ("one_load", one["load"]),
                             ("py_set", py["SET"]), ("py_get", py["GET"])):
                    runs[k].append(v)
                bar.update()
            rows.append({"size": size, "n": n, "c": c, **{k: statistics.median(v) for k, v in runs.items()},
                         "load_ratios": [o / r for o, r in zip(runs["load"], runs["rb_get"])]})
        pool.close()
    bar.close()
    flush.flushall()
    return rows


def print_bandwidth(rows: list[dict], pipeline: int) -> None:
    print(f"\nBandwidth, GB/s (median; c connections, at most {pipeline} commands outstanding per connection; "
          f"redis-benchmark GET credited only with the GETs that returned a value)")
    print("| value | c | redis-benchmark SET | ours store | ratio | redis-benchmark GET (hit share) | ours load "
          "| ratio | ours one load job | ratio | redis-py SET / GET |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['size'] >> 10} KiB | {r['c']} | {r['rb_set']:.2f} | {r['store']:.2f} | "
              f"{r['store'] / r['rb_set']:.2f} | {r['rb_get']:.2f} ({r['hit_share']:.2f}) | {r['load']:.2f} "
              f"| {r['load'] / r['rb_get']:.2f} | {r['one_load']:.2f} | {r['one_load'] / r['rb_get']:.2f} "
              f"| {r['py_set']:.2f} / {r['py_get']:.2f} |")
    print("per-run load / redis-benchmark GET ratios: " + "; ".join(
        f"{r['size'] >> 10} KiB c={r['c']}: " + ", ".join(f"{x:.2f}" for x in r["load_ratios"]) for r in rows))


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.get("c", 1) == 1]
    x = np.arange(len(rows))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, (title, ref, mine, py) in zip(axes, (("store (SET)", "rb_set", "store", "py_set"),
                                                  ("load (GET)", "rb_get", "load", "py_get"))):
        ax.bar(x - 0.27, [r[ref] for r in rows], 0.27, label="redis-benchmark")
        ax.bar(x, [r[mine] for r in rows], 0.27, label="kvoffload remote worker")
        ax.bar(x + 0.27, [r[py] for r in rows], 0.27, label="redis-py pipeline")
        ax.set_xticks(x, [f"{r['size'] >> 10} KiB" for r in rows])
        ax.set_title(title)
    axes[0].set_ylabel("GB/s (loopback, one connection)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")
