"""The Mooncake tier against a real mooncake_master + store node: bytes
come back exactly, lookups go RETRY -> HIT/MISS, namespaces and prefixes
never mix, and another process's stores are hits here."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from kvoffload.abstractions import CPULoadStoreSpec, LookupResult
from kvoffload.tiers.base import Namespace
from kvoffload.tiers.mooncake import MooncakeTier
from mooncake_helpers import CTX, PATIENT, expected, fill, keys_for, load, lookup, make_tier, store

pytestmark = pytest.mark.mooncake

HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY
PROC = Path(__file__).with_name("mooncake_engine_proc.py")


@pytest.mark.parametrize("chunk_bytes", [4096, 5000, 256 << 10])
def test_round_trip_bit_exact(mooncake, prefix, chunk_bytes):
    n = 12
    tier, m, w, pool = make_tier(mooncake, prefix, num_chunks=2 * n, chunk_bytes=chunk_bytes)
    try:
        keys = keys_for(n, seed=1)
        assert m.lookup(keys[0], CTX) is RETRY  # never answered from the network on this thread
        assert all(lookup(m, k) is MISS for k in keys)
        fill(pool, range(n), seed=1)
        assert store(m, w, keys, list(range(n)))
        m.reset_cache()
        assert all(lookup(m, k) is HIT for k in keys)
        pool.array[n:] = 0
        assert load(m, w, keys, list(range(n, 2 * n)))
        for j in range(n):
            assert np.array_equal(pool.chunk(n + j)[:chunk_bytes], expected(pool, 1, j))
        c = m.get_stats().counters
        assert c["loaded_blocks"] == n and c["stored_blocks"] == n and c.get("checksum_failures", 0) == 0
    finally:
        tier.shutdown()


def test_tier_lending_its_own_memory(mooncake, prefix):
    """segment_bytes > 0: this process's memory holds values too (the default deployment shape)."""
    tier, m, w, pool = make_tier(mooncake, prefix, num_chunks=8, segment_bytes=32 << 20)
    try:
        keys = keys_for(4, seed=2)
        fill(pool, range(4), seed=2)
        assert store(m, w, keys, [0, 1, 2, 3])
        assert load(m, w, keys, [4, 5, 6, 7])
        assert all(np.array_equal(pool.chunk(4 + j), pool.chunk(j)) for j in range(4))
    finally:
        tier.shutdown()


def test_namespaces_and_prefixes_never_mix(mooncake, prefix):
    tier, m, w, pool = make_tier(mooncake, prefix, num_chunks=4)
    other_ns = Namespace(model="other", dtype="bf16", layout="canon", block_size=16, chunk_bytes=pool.used_chunk_bytes)
    other = MooncakeTier(mooncake.tier_config(key_prefix=prefix, segment_bytes=0, **PATIENT), other_ns)
    other_prefix, m3, _, _ = make_tier(mooncake, prefix + "-x", num_chunks=4)
    try:
        keys = keys_for(3, seed=3)
        fill(pool, range(3), seed=3)
        assert store(m, w, keys, [0, 1, 2])
        assert all(lookup(other.get_manager(), k) is MISS for k in keys)
        assert all(lookup(m3, k) is MISS for k in keys)
        assert all(lookup(m, k) is HIT for k in keys)
    finally:
        for t in (tier, other, other_prefix):
            t.shutdown()


def test_one_process_stores_another_hits(mooncake, prefix):
    """Two engines (processes) share the store: what one stored and left behind, the other reads exactly."""
    n, seed = 10, 77
    tier, m, w, pool = make_tier(mooncake, prefix, num_chunks=n)
    try:
        keys = keys_for(n, seed=seed)
        assert all(lookup(m, k) is MISS for k in keys)
        out = subprocess.run([sys.executable, str(PROC), mooncake.master_address, mooncake.metadata_server,
                              prefix, str(seed), str(n)], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        m.reset_cache()
        assert all(lookup(m, k) is HIT for k in keys)
        assert load(m, w, keys, list(range(n)))
        for j in range(n):
            assert np.array_equal(pool.chunk(j)[: pool.used_chunk_bytes], expected(pool, seed, j))
    finally:
        tier.shutdown()


def test_many_rounds_and_threads(mooncake, prefix):
    """Jobs larger than one batched call (batch_bytes of 2 chunks) on two IO threads at once, each with
    its own registered header buffer: every byte still comes back."""
    n, chunk = 24, 16 << 10
    tier, m, w, pool = make_tier(mooncake, prefix, num_chunks=2 * n, chunk_bytes=chunk, io_threads=2,
                                 batch_bytes=2 * chunk)
    try:
        keys = keys_for(n, seed=9)
        fill(pool, range(n), seed=9)
        halves = [list(range(0, n, 2)), list(range(1, n, 2))]
        out = [m.prepare_store([keys[s] for s in h], CTX) for h in halves]
        for job, (h, o) in enumerate(zip(halves, out), start=1):  # both in flight together
            assert w.submit_store(job, CPULoadStoreSpec(h), o.store_spec)
        w.wait({1, 2})
        assert all(r.success for r in w.get_finished())
        for h in halves:
            m.complete_store([keys[s] for s in h], CTX)
        assert load(m, w, keys, list(range(n, 2 * n)))
        for j in range(n):
            assert np.array_equal(pool.chunk(n + j)[:chunk], expected(pool, 9, j))
    finally:
        tier.shutdown()


class _GetSizes:
    """The tier's real client, with the number of values of each batched get recorded."""

    def __init__(self, client):
        self._client, self.gets, self._lock = client, [], threading.Lock()

    def batch_get_into(self, keys, pointers, sizes):
        with self._lock:
            self.gets.append(len(keys))
        return self._client.batch_get_into(keys, pointers, sizes)

    def __getattr__(self, name):
        return getattr(self._client, name)


@pytest.mark.parametrize("io_threads, batch_chunks, calls", [(3, 32, [10]), (4, 4, [3, 3, 4]), (1, 4, [2, 4, 4])])
def test_large_load_split_over_threads_by_whole_rounds(mooncake, prefix, io_threads, batch_chunks, calls):
    """A 10 MiB load goes out in batched gets of up to batch_bytes each, over
    at most io_threads parts, never cut smaller to feed more threads (the
    client moves one call over several TCP lanes itself; smaller calls from
    more threads are slower): one result for the job, every byte back."""
    n, chunk = 10, 1 << 20
    tier, m, w, pool = make_tier(mooncake, prefix, num_chunks=2 * n, chunk_bytes=chunk, io_threads=io_threads,
                                 batch_bytes=batch_chunks * chunk)
    try:
        w._client = spy = _GetSizes(w._client)
        keys = keys_for(n, seed=10)
        fill(pool, range(n), seed=10)
        out = m.prepare_store(keys, CTX)
        assert w.submit_store(1, CPULoadStoreSpec(list(range(n))), out.store_spec)
        w.wait({1})
        assert all(r.success for r in w.get_finished())
        m.complete_store(keys, CTX)
        spec = m.prepare_load(keys, CTX)
        assert w.submit_load(2, spec, CPULoadStoreSpec(list(range(n, 2 * n))))
        w.wait({2})
        done = w.get_finished()
        m.complete_load(keys, CTX)
        assert [(r.job_id, r.success, r.transfer_size) for r in done] == [(2, True, n * pool.used_chunk_bytes)]
        assert sorted(spy.gets) == calls
        for j in range(n):
            assert np.array_equal(pool.chunk(n + j)[:chunk], expected(pool, 10, j))
    finally:
        tier.shutdown()


def test_shutdown_right_after_submitting_stores_puts_them_all(mooncake, prefix):
    """Stores still being hashed when the worker shuts down are put, not
    dropped: each is reported, and another tier reads every byte."""
    n, chunk = 16, 1 << 20
    tier, m, w, pool = make_tier(mooncake, prefix, num_chunks=n, chunk_bytes=chunk)
    reader, m2, w2, pool2 = make_tier(mooncake, prefix, num_chunks=n, chunk_bytes=chunk)
    try:
        keys = keys_for(n, seed=12)
        fill(pool, range(n), seed=12)
        jobs = [list(range(a, a + 4)) for a in range(0, n, 4)]  # 4 MiB each; the first, alone, hashed in two pieces
        outs = [m.prepare_store([keys[s] for s in j], CTX) for j in jobs]
        for job_id, (j, o) in enumerate(zip(jobs, outs), start=1):
            assert w.submit_store(job_id, CPULoadStoreSpec(j), o.store_spec)
        w.shutdown()  # at once: nothing waited for
        assert sorted((r.job_id, r.success) for r in w.get_finished()) == [(i, True) for i in range(1, 5)]
        assert all(lookup(m2, k) is HIT for k in keys)
        assert load(m2, w2, keys, list(range(n)))
        for j in range(n):
            assert np.array_equal(pool2.chunk(j)[:chunk], expected(pool, 12, j))
    finally:
        tier.shutdown()
        reader.shutdown()
