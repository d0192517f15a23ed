"""Part 3 of bench_remote.py: what the shared secret (remote.mac_key_file,
a keyed MAC over key + header + payload) costs our store / load, in
alternating runs with and without it, beside the single-thread rates of
the hashes alone."""

from __future__ import annotations

import statistics
import tempfile
import time

import numpy as np
import redis

from kvoffload.tiers.host_pool import HostPool
from kvoffload.tiers.redis.server import LocalServer
from remote_bandwidth import ours


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
