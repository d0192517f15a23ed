"""Part 4 of bench_remote.py: the Mooncake tier's bandwidth against the
Mooncake client's own batched zero-copy calls, in the same run.

A real mooncake_master and one mooncake_client store node on loopback hold
the values (the tier and the reference lend no memory, so every value
crosses loopback TCP to the node). Per value size, each repeat moves the
values in segments (2 of our jobs, at least 32 MiB) and times, per segment,
with fresh keys, in a rotating order so that load from other processes
(this machine is shared) hits all of them alike:

- puts: the client's own `batch_put_from` of the slots (the reference),
  the tier's earlier two-buffer layout ("2-buf": `batch_put_from_multi_buffers`
  of a 48-byte header from a registered buffer + the slot, no hashing), and
  our worker's stores (jobs of `batch` chunks; one buffer per key, the chunk
  then its 48-byte header written into the slot's trailer room: our values
  are 48 bytes longer than the reference's);
- gets: `batch_get_into`, `batch_get_into_multi_buffers`, and our loads
  (jobs of `batch` chunks, each value checked), then our load of all the
  chunks as one job.

Reference calls carry `batch` values each (as our rounds do: batch_bytes =
batch x value size) and are shared out over as many threads as our
io_threads, all calling at once. A repeat's GB/s is its bytes over the sum
of its segments' times; ratios are the median over repeats of ours /
reference within one repeat.
"""

from __future__ import annotations

import ctypes
import mmap
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvoffload.abstractions import CPULoadStoreSpec
from kvoffload.tiers.base import Namespace
from kvoffload.tiers.host_pool import HostPool
from kvoffload.tiers.remote.value import HEADER_BYTES, OK, RemoteLoadStoreSpec, ValueCodec


class NoChecksumCodec(ValueCodec):
    """Benchmark only (--mooncake-no-checksum): every header the same, every
    value accepted, so a run shows what the checksums cost. Never in the tier."""

    def __init__(self, size: int):
        super().__init__()
        self._header = ValueCodec().header(b"", bytes(size))

    def header(self, redis_key, payload):
        return self._header

    def verify(self, redis_key, header, payload):
        return OK


def reference(store, op: str, keys: list[str], seg: range, pool: HostPool, batch: int, callers: int,
              headers: int | None = None) -> float:
    """Seconds of the client's own batched put (op "put") or get of slots seg
    (keys[i] for slot i); headers: address of a registered buffer, for the
    two-buffer calls (value i's 48 bytes at headers + 48 i, then its slot)."""
    base, cb, size = pool.tensor.data_ptr(), pool.chunk_bytes, pool.used_chunk_bytes
    batches = [range(a, min(seg.stop, a + batch)) for a in range(seg.start, seg.stop, batch)]
    want = 0 if op == "put" else size + (HEADER_BYTES if headers else 0)

    def call(idx):
        ks = [keys[i] for i in idx]
        if headers is None:
            args = (ks, [base + i * cb for i in idx], [size] * len(idx))
            codes = store.batch_put_from(*args) if op == "put" else store.batch_get_into(*args)
        else:
            args = (ks, [[headers + i * HEADER_BYTES, base + i * cb] for i in idx], [[HEADER_BYTES, size]] * len(idx))
            codes = (store.batch_put_from_multi_buffers(*args) if op == "put"
                     else store.batch_get_into_multi_buffers(*args))
        assert all(c == want for c in codes), f"mooncake {op}: {set(codes)}"

    if callers == 1:
        t0 = time.perf_counter()
        for idx in batches:
            call(idx)
        return time.perf_counter() - t0
    with ThreadPoolExecutor(callers) as ex:
        t0 = time.perf_counter()
        list(ex.map(call, batches))
        return time.perf_counter() - t0


def ours(worker, op: str, rkeys: list[str], keys: list[bytes], seg: range, per_job: int) -> float:
    """Seconds of our worker storing (op "put") or loading slots seg in jobs
    of per_job chunks, all submitted at once."""
    jobs = [list(range(a, min(seg.stop, a + per_job))) for a in range(seg.start, seg.stop, per_job)]
    t0 = time.perf_counter()
    for j, slots in enumerate(jobs):
        spec = RemoteLoadStoreSpec([rkeys[s] for s in slots], [keys[s] for s in slots])
        if op == "put":
            assert worker.submit_store(j, CPULoadStoreSpec(slots), spec)
        else:
            assert worker.submit_load(j, spec, CPULoadStoreSpec(slots))
    worker.wait(set(range(len(jobs))))
    dt = time.perf_counter() - t0
    done = worker.get_finished()
    assert all(r.success for r in done), f"{op}: {sum(not r.success for r in done)} jobs failed"
    return dt


def mooncake_bandwidth(sizes: list[int], total: int, repeats: int, batch: int,
                       io_threads: int | None = None, no_checksum: bool = False) -> list[dict]:
    from mooncake.store import MooncakeDistributedStore
    from tqdm import tqdm

    from kvoffload.tiers.mooncake import MooncakeTier
    from kvoffload.tiers.mooncake.server import LocalMooncake

    rows = []
    store_bytes = max(1 << 30, 4 * total)  # three key sets of one repeat, and room
    with LocalMooncake(store_bytes=store_bytes) as srv:
        print(f"mooncake: master {srv.master_address}, store node lending {store_bytes >> 20} MiB")
        ref = MooncakeDistributedStore()  # a plain client, set up as our tier sets its own up
        assert ref.setup("127.0.0.1", srv.metadata_server, 0, 16 << 20, "tcp", "", srv.master_address) == 0
        bar = tqdm(total=len(sizes) * repeats, desc="mooncake bandwidth", unit="run")
        for size in sizes:
            n = max(batch, total // size)
            pool = HostPool(n, size, trailer_bytes=HEADER_BYTES)  # the tier keeps each header after its chunk
            pool.array[:] = np.random.default_rng(size).integers(0, 256, pool.array.shape, dtype=np.uint8)
            before = pool.array[:, :size].copy()  # the chunks (a slot's trailer holds our header)
            hmm = mmap.mmap(-1, max(n * HEADER_BYTES, mmap.PAGESIZE))
            haddr = ctypes.addressof(ctypes.c_char.from_buffer(hmm))
            assert ref.register_buffer(pool.tensor.data_ptr(), pool.nbytes) == 0
            assert ref.register_buffer(haddr, len(hmm)) == 0
            tier = MooncakeTier(srv.tier_config(key_prefix=f"bench{time.monotonic_ns()}", segment_bytes=0,
                                                batch_bytes=batch * size,
                                                **({"io_threads": io_threads} if io_threads else {})),
                                Namespace(model="bench", chunk_bytes=size))
            worker = tier.get_worker(pool)
            if no_checksum:
                worker._codec = NoChecksumCodec(size)
            callers = tier.config.io_threads
            keys = [i.to_bytes(8, "big") + b"\0\0\0\0" for i in range(n)]
            rkeys = tier.keyspace.redis_keys(keys)

            seg_len = max(2 * batch, (32 << 20) // size)
            segments = [range(a, min(n, a + seg_len)) for a in range(0, n, seg_len)]

            def run(segs: list[range], rep: int) -> dict[str, float]:
                tag = f"{rep}:{time.monotonic_ns()}"
                k1, k2 = [f"ref{tag}:{i}" for i in range(n)], [f"ref2{tag}:{i}" for i in range(n)]
                steps = {"put": {"mc_put": lambda g: reference(ref, "put", k1, g, pool, batch, callers),
                                 "mc_put2": lambda g: reference(ref, "put", k2, g, pool, batch, callers, haddr),
                                 "store": lambda g: ours(worker, "put", rkeys, keys, g, batch)},
                         "get": {"mc_get": lambda g: reference(ref, "get", k1, g, pool, batch, callers),
                                 "mc_get2": lambda g: reference(ref, "get", k2, g, pool, batch, callers, haddr),
                                 "load": lambda g: ours(worker, "get", rkeys, keys, g, batch),
                                 "one_load": lambda g: ours(worker, "get", rkeys, keys, g, len(g))}}
                secs: dict[str, float] = {}
                for i, seg in enumerate(segs):
                    for step in steps.values():
                        names = list(step)
                        names = names[(rep + i) % len(names):] + names[: (rep + i) % len(names)]
                        for name in names:
                            secs[name] = secs.get(name, 0.0) + step[name](seg)
                assert np.array_equal(pool.array[:, :size], before), "mooncake: loaded bytes differ"
                ref.remove_all(True)
                moved = sum(len(g) for g in segs) * size
                return {name: moved / t / 1e9 for name, t in secs.items()}

            run(segments[:1], 0)  # untimed: every client's connections to the store node are then open
            runs = []
            for rep in range(repeats):
                runs.append(run(segments, rep))
                bar.update()
            tier.shutdown()
            ref.unregister_buffer(haddr)
            ref.unregister_buffer(pool.tensor.data_ptr())
            pool.close()
            row = {"size": size, "n": n, "callers": callers, "runs": runs,
                   **{k: statistics.median(r[k] for r in runs) for k in runs[0]}}
            for k, base in (("mc_put2", "mc_put"), ("store", "mc_put"), ("mc_get2", "mc_get"), ("load", "mc_get"),
                            ("one_load", "mc_get")):
                row[k + "_ratio"] = statistics.median(r[k] / r[base] for r in runs)
            rows.append(row)
        bar.close()
        ref.close()
    return rows


def print_mooncake(rows: list[dict], batch: int, redis_rows: list[dict] | None) -> None:
    redis_by_size = {r["size"]: r for r in redis_rows or [] if r.get("c", 1) == 1}
    print(f"\nMooncake tier, GB/s (median; values held by a store node over loopback TCP, {batch} values per "
          f"batched call; the reference calls from as many threads as our io_threads; ratios: median over "
          f"repeats of ours / the client's own batch_put_from or batch_get_into in the same repeat; "
          f"2-buf: the client's own calls with the earlier two-buffer value layout, 48-byte header + slot, "
          f"no hashing; ours: one buffer per key, the chunk then its 48-byte header)")
    print("| value | threads | batch_put_from | 2-buf | ratio | ours store | ratio | batch_get_into | 2-buf | ratio "
          "| ours load | ratio | ours one load job | ratio | Redis tier store / load |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        rr = redis_by_size.get(r["size"])
        redis = f"{rr['store']:.2f} / {rr['load']:.2f}" if rr else "n/a"
        print(f"| {r['size'] >> 10} KiB | {r['callers']} | {r['mc_put']:.2f} | {r['mc_put2']:.2f} "
              f"| {r['mc_put2_ratio']:.2f} | {r['store']:.2f} | {r['store_ratio']:.2f} | {r['mc_get']:.2f} "
              f"| {r['mc_get2']:.2f} | {r['mc_get2_ratio']:.2f} | {r['load']:.2f} | {r['load_ratio']:.2f} "
              f"| {r['one_load']:.2f} | {r['one_load_ratio']:.2f} | {redis} |")
