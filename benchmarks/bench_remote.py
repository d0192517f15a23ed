"""Remote tier benchmark, against references measured in the same run.

1. Bandwidth: the remote worker storing / loading host-pool chunks
   (pipelined, zero-copy sends, reads straight into the pool), as a ratio
   of `redis-benchmark` SET / GET with the same value size, connection
   count (--connections: redis-benchmark -c, our io_threads) and pipeline
   depth (-P; our batch_bytes = P x value size: at most P commands
   outstanding per connection on both sides), on the same server, in the
   same run. redis-benchmark's GET is credited only with the GETs that
   returned a value (see redis_benchmark()). Loads are measured twice: in
   jobs of P chunks, and as one load job of all the chunks (split over the
   connections). redis-py pipelines (copying values into bytes objects) are
   shown too (one connection).
2. Sharing: the shared Mooncake trace split round-robin across two
   simulated engines (kvoffload's replay engine, in two threads at once),
   each with a small CPU tier, over one remote tier; once with the engines
   isolated (a key prefix each) and once sharing one prefix. The gain is
   the cross-instance hits: blocks one engine computed and the other
   reused, their bytes verified on load.
3. (--mac-cost) What the shared secret (remote.mac_key_file: BLAKE2b keyed
   MAC over key + header + payload) costs: our store / load with and
   without it, alternating runs, and the ratio; plus the single-thread
   rates of the two hashes over the same bytes.

    .venv/bin/python benchmarks/bench_remote.py            # parts 1 and 2
    .venv/bin/python benchmarks/bench_remote.py --requests 12031 --plot docs/remote_bench.png
    .venv/bin/python benchmarks/bench_remote.py --skip-bandwidth --skip-replay --mac-cost
    .venv/bin/python benchmarks/bench_remote.py --skip-replay --mooncake   # parts 1 and 4 side by side
    .venv/bin/python benchmarks/bench_remote.py --skip-replay --connections 1,2,4

4. (--mooncake) The Mooncake Store tier (a real mooncake_master and a
   mooncake_client store node on loopback, values held by the node): our
   worker storing / loading host-pool chunks (registered pool, batched
   zero-copy put/get of header + slot, header checked on load) as a ratio
   of the Mooncake client's own batch_put_from / batch_get_into of the same
   values from / into the same registered slots, in the same run and with
   the same values per call; beside the Redis tier's rates from part 1.
   How it is measured: benchmarks/mooncake_bandwidth.py.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import redis

from kvoffload.config import parse_bytes
from kvoffload.tiers.base import Namespace
from kvoffload.tiers.host_pool import HostPool
from kvoffload.tiers.remote import RemoteTier
from kvoffload.tiers.remote.server import LocalServer, find_benchmark_binary
from shared_traces import shared_trace_path
from mooncake_bandwidth import mooncake_bandwidth, print_mooncake
from mooncake_bandwidth import ours as time_jobs  # one worker, jobs submitted at once

TRACE = shared_trace_path()


# ---- 1. bandwidth --------------------------------------------------------------------------

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


# ---- 3. cost of the MAC ----------------------------------------------------------------------

def _has_blake3() -> bool:
    try:
        import blake3  # noqa: F401
    except ImportError:
        return False
    return True


def hash_rates(size: int, repeats: int = 20) -> dict[str, float]:
    """Single-thread GB/s over size bytes of xxh3_64 (always on) and of the keyed MACs."""
    import hashlib

    import xxhash

    buf = memoryview(np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8))
    key = bytes(32)
    fns = {"xxh3": lambda: xxhash.xxh3_64_intdigest(buf),
           "blake2b": lambda: hashlib.blake2b(buf, key=key, digest_size=16).digest()}
    if _has_blake3():
        import blake3

        fns["blake3"] = lambda: blake3.blake3(buf, key=key).digest()
    rates = {}
    for name, fn in fns.items():
        fn()
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        rates[name] = size * repeats / (time.perf_counter() - t0) / 1e9
    return rates


def mac_cost(srv: LocalServer, sizes: list[int], total: int, repeats: int, pipeline: int) -> list[dict]:
    flush = redis.Redis(port=srv.port)
    rows = []
    with tempfile.NamedTemporaryFile("w", suffix=".key") as kf:
        kf.write("bench secret, not a real one: 0123456789abcdef")
        kf.flush()
        for size in sizes:
            n = max(pipeline, total // size)
            pool = HostPool(n, size)
            pool.array[:] = np.random.default_rng(size).integers(0, 256, pool.array.shape, dtype=np.uint8)
            before = pool.array.copy()
            variants = [("", {}), ("_mac", {"mac_key_file": kf.name})]
            if _has_blake3():
                variants.append(("_b3", {"mac_key_file": kf.name, "mac_algorithm": "blake3"}))
            runs = {k + suffix: [] for suffix, _ in variants for k in ("store", "load")}
            for _ in range(repeats):  # alternate, so drift in the machine hits all alike
                for suffix, conf in variants:
                    flush.flushall()
                    o = ours(srv.url, pool, n, pipeline, **conf)
                    assert np.array_equal(pool.array, before), "loaded bytes differ"
                    runs["store" + suffix].append(o["store"])
                    runs["load" + suffix].append(o["load"])
            pool.close()
            rows.append({"size": size, **{k: statistics.median(v) for k, v in runs.items()}, **hash_rates(size)})
    flush.flushall()
    return rows


def print_mac_cost(rows: list[dict], pipeline: int, repeats: int) -> None:
    print(f"\nCost of the MAC, GB/s (median of {repeats} alternating runs; one connection, {pipeline} values "
          f"per round)")
    b3 = "store_b3" in rows[0]
    print("| value | MAC | store | ratio | load | ratio | hash alone, 1 thread |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        kib = f"{r['size'] >> 10} KiB"
        print(f"| {kib} | none (xxh3 checksum) | {r['store']:.2f} | 1 | {r['load']:.2f} | 1 | {r['xxh3']:.1f} |")
        for suffix, name in (("_mac", "blake2b"), ("_b3", "blake3"))[: 2 if b3 else 1]:
            print(f"| {kib} | {name} | {r['store' + suffix]:.2f} | {r['store' + suffix] / r['store']:.2f} "
                  f"| {r['load' + suffix]:.2f} | {r['load' + suffix] / r['load']:.2f} | {r[name]:.2f} |")


# ---- 2. two engines sharing the tier -------------------------------------------------------

def two_engines(url: str, trace_path: Path, requests: int, cpu_share: float, shared: bool,
                tier_conf: dict | None = None, kind: str = "redis") -> dict:
    """kind "mooncake": url is ignored, tier_conf says where the store is."""
    from kvoffload.replay.engine import EngineOptions, ReplayEngine
    from kvoffload.replay.traces import Trace, load_trace

    trace = load_trace(trace_path, limit=requests)
    halves = [Trace(f"{trace.name}[{i}::2]", trace.block_size, trace.requests[i::2]) for i in (0, 1)]
    cpu_blocks = max(16, int(cpu_share * trace.num_unique_blocks()))
    run_id = time.monotonic_ns()
    engines, results, errors = [], [None, None], []
    for i, half in enumerate(halves):
        prefix = f"share{run_id}" if shared else f"iso{run_id}-{i}"
        opts = EngineOptions(spec="tiered", progress=False, extra_config={
            "num_cpu_chunks": cpu_blocks,
            # a deep queue: measure sharing, not the tiering manager's back-pressure on a loaded machine
            "secondary_tiers": [{"type": kind, **({"url": url} if kind == "redis" else {}), "key_prefix": prefix,
                                 "max_queue_depth": 1 << 16, **(tier_conf or {})}]})
        engines.append(ReplayEngine(half, opts))

    def run(i):
        try:
            results[i] = engines[i].run()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    for e in engines:
        e.close()
    if errors:
        raise errors[0]
    out = {"wall_s": wall, "cpu_blocks": cpu_blocks, "engines": []}
    for res in results:
        c = res.counters
        remote = res.tiers.get(kind, {}).get("counters", {})
        cpu = res.tiers.get("cpu", {}).get("counters", {})
        out["engines"].append({
            "block_refs": c["block_refs"], "offload_hits": c["offload_hit_blocks"],
            "remote_hits": remote.get("promoted_blocks", 0), "cpu_hits": cpu.get("hits", 0),
            "verified": c["verified_blocks"], "verify_failures": c["verify_failures"],
            "remote_stored": remote.get("stored_blocks", 0), "remote_dropped": remote.get("dropped_stores", 0),
            "delay_timeouts": c["delay_timeouts"]})
    return out


def infinite_cache_rates(trace_path: Path, requests: int) -> tuple[float, float]:
    """Prefix hit rate with an infinite cache per engine (isolated) and one
    shared by both: the ceilings the two runs aim at."""
    from kvoffload.replay.traces import load_trace

    reqs = [r.block_hashes for r in load_trace(trace_path, limit=requests).requests]

    def hits(rs):
        seen, n = set(), 0
        for h in rs:
            for b in h:
                if b not in seen:
                    break
                n += 1
            seen.update(h)
        return n

    refs = sum(len(h) for h in reqs)
    return (hits(reqs[0::2]) + hits(reqs[1::2])) / refs, hits(reqs) / refs


def print_sharing(iso: dict, sh: dict, requests: int, ceilings: tuple[float, float], kind: str = "redis") -> None:
    print(f"\nTwo engines, {requests} requests of the Mooncake trace split round-robin, "
          f"CPU tier {iso['cpu_blocks']} blocks each, one remote tier ({kind})")
    print("| run | engine | block refs | offload prefix hits | promoted from remote | hit rate | verified "
          "| stored to / dropped by remote |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in (("isolated (prefix each)", iso), ("shared (one prefix)", sh)):
        for i, e in enumerate(r["engines"]):
            print(f"| {name} | {i} | {e['block_refs']:,} | {e['offload_hits']:,} | {e['remote_hits']:,} | "
                  f"{e['offload_hits'] / max(1, e['block_refs']):.4f} | {e['verified']:,} "
                  f"({e['verify_failures']} bad) | {e['remote_stored']:,} / {e['remote_dropped']:,} |")
    hits_iso = sum(e["offload_hits"] for e in iso["engines"])
    hits_sh = sum(e["offload_hits"] for e in sh["engines"])
    refs = sum(e["block_refs"] for e in sh["engines"])
    print(f"cross-instance hits (shared - isolated prefix hits): {hits_sh - hits_iso:,} blocks; "
          f"fleet prefix hit rate {hits_iso / refs:.4f} isolated -> {hits_sh / refs:.4f} shared "
          f"(x{hits_sh / max(1, hits_iso):.2f}); infinite-cache ceilings {ceilings[0]:.4f} isolated, "
          f"{ceilings[1]:.4f} shared")


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


def _json_or_str(v: str):
    try:
        return json.loads(v)
    except ValueError:
        return v


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="256KiB,1MiB,4MiB", help="value sizes")
    ap.add_argument("--total", default="256MiB", help="bytes moved per size and run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pipeline", type=int, default=16, help="values per pipeline round (redis-benchmark -P)")
    ap.add_argument("--connections", default="1", help="connection counts to measure, e.g. 1,2,4 (redis-benchmark "
                    "-c; our io_threads)")
    ap.add_argument("--trace", default=str(TRACE.resolve()))
    ap.add_argument("--requests", type=int, default=2000, help="trace requests replayed (12031: all)")
    ap.add_argument("--cpu-share", type=float, default=0.05, help="CPU tier per engine, share of unique blocks")
    ap.add_argument("--tier", action="append", default=[], metavar="KEY=VALUE",
                    help="remote tier setting for the replay, e.g. miss_cache_s=2 (VALUE as JSON)")
    ap.add_argument("--skip-bandwidth", action="store_true")
    ap.add_argument("--skip-replay", action="store_true")
    ap.add_argument("--plot", help="write a PNG of the bandwidth table here")
    ap.add_argument("--mac-cost", action="store_true", help="also measure store / load with and without the MAC")
    ap.add_argument("--mooncake", action="store_true", help="also measure the Mooncake tier (part 4)")
    ap.add_argument("--mooncake-io-threads", type=int, help="the Mooncake tier's io_threads (part 4; default: "
                    "the tier's)")
    ap.add_argument("--mooncake-store", default="6GiB",
                    help="memory the store node lends for --replay-mooncake (the whole trace stores ~1.7 GB "
                         "per run; a full store evicts)")
    ap.add_argument("--mooncake-no-checksum", action="store_true",
                    help="part 4 with the tier's checksums off (a constant header, no check): what they cost; "
                         "benchmark only")
    ap.add_argument("--mooncake-json", help="also write part 4's rows, with each repeat's GB/s, to this JSON file")
    ap.add_argument("--replay-mooncake", action="store_true",
                    help="also run part 2 with the Mooncake tier as the shared remote tier")
    args = ap.parse_args(argv)
    if find_benchmark_binary() is None and not args.skip_bandwidth:
        sys.exit("redis-benchmark not found (Debian: apt-get install redis-server)")
    sizes = [parse_bytes(s, "--sizes") for s in args.sizes.split(",")]
    rows = None
    with LocalServer(maxmemory="3gb") as srv:
        print(f"server: {srv.binary} on 127.0.0.1:{srv.port}, no persistence, allkeys-lru")
        if not args.skip_bandwidth:
            rows = bandwidth(srv, sizes, parse_bytes(args.total, "--total"), args.repeats, args.pipeline,
                             [int(c) for c in args.connections.split(",")])
            print_bandwidth(rows, args.pipeline)
            if args.plot:
                plot(rows, args.plot)
        if args.mac_cost:
            rows = mac_cost(srv, sizes, parse_bytes(args.total, "--total"), args.repeats, args.pipeline)
            print_mac_cost(rows, args.pipeline, args.repeats)
        if not args.skip_replay:
            from tqdm import tqdm

            conf = {k: _json_or_str(v) for k, v in (kv.split("=", 1) for kv in args.tier)}
            with tqdm(total=2, desc="two-engine replay", unit="run") as bar:
                iso = two_engines(srv.url, Path(args.trace), args.requests, args.cpu_share, False, conf)
                bar.update()
                sh = two_engines(srv.url, Path(args.trace), args.requests, args.cpu_share, True, conf)
                bar.update()
            print_sharing(iso, sh, args.requests, infinite_cache_rates(Path(args.trace), args.requests))
    if args.mooncake:
        mc = mooncake_bandwidth(sizes, parse_bytes(args.total, "--total"), args.repeats, args.pipeline,
                                args.mooncake_io_threads, args.mooncake_no_checksum)
        print_mooncake(mc, args.pipeline, rows)
        if args.mooncake_json:
            Path(args.mooncake_json).write_text(json.dumps(mc, indent=1))
    if args.replay_mooncake:
        from kvoffload.tiers.mooncake.server import LocalMooncake

        with LocalMooncake(store_bytes=parse_bytes(args.mooncake_store, "--mooncake-store")) as mc_srv:
            conf = {**mc_srv.tier_config(segment_bytes=0),
                    **{k: _json_or_str(v) for k, v in (kv.split("=", 1) for kv in args.tier)}}
            runs = [two_engines("", Path(args.trace), args.requests, args.cpu_share, shared, conf, "mooncake")
                    for shared in (False, True)]
        print_sharing(*runs, args.requests, infinite_cache_rates(Path(args.trace), args.requests), "mooncake")
    return 0


if __name__ == "__main__":
    sys.exit(main())
