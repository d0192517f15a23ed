"""A value changed through Mooncake's own client (as a bug or another
writer would) is a counted miss, removed, never served."""

from __future__ import annotations

import numpy as np
import pytest

from kvoffload.abstractions import CPULoadStoreSpec, LookupResult
from kvoffload.tiers.remote.value import HEADER_BYTES
from mooncake_helpers import CTX, fill, keys_for, load, lookup, make_tier, store, wait_until

pytestmark = pytest.mark.mooncake


@pytest.fixture(scope="module")
def raw(mooncake):
    """A plain Mooncake client of the test's own (no kvoffload code)."""
    from mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", mooncake.metadata_server, 0, 32 << 20, "tcp", "", mooncake.master_address) == 0
    yield s
    s.close()


def _replace(raw, key: str, value: bytes) -> None:
    # a lease from a recent read blocks a plain remove for lease_ms: wait it out
    wait_until(lambda: raw.remove(key, True) == 0 or raw.is_exist(key) == 0, "old value removed")
    assert raw.put(key, value) == 0


@pytest.mark.parametrize("how", ["flip_payload", "flip_header", "truncate", "foreign", "other_key", "header_first"])
def test_damaged_value_is_a_miss(mooncake, raw, prefix, how):
    chunk = 8192
    tier, m, w, pool = make_tier(mooncake, prefix, num_chunks=8, chunk_bytes=chunk)
    try:
        keys = keys_for(3, seed=20)
        fill(pool, range(3), seed=20)
        assert store(m, w, keys, [0, 1, 2])
        rkey = tier.keyspace.redis_key(keys[1])
        good = raw.get(rkey)
        assert len(good) == chunk + HEADER_BYTES and good[chunk:chunk + 4] == b"KVOF"  # chunk, then header
        if how == "flip_payload":
            v = bytearray(good)
            v[1000] ^= 0x40
            bad = bytes(v)
        elif how == "flip_header":  # the header is the value's last 48 bytes
            bad = good[:chunk] + b"KVOX" + good[chunk + 4:]
        elif how == "truncate":
            bad = good[:-1]
        elif how == "header_first":  # the layout before the trailer (same length): not ours
            bad = good[chunk:] + good[:chunk]
        elif how == "foreign":
            bad = b"hello, not a KV chunk"
        else:  # a valid value of another key, copied here
            bad = raw.get(tier.keyspace.redis_key(keys[0]))
        _replace(raw, rkey, bad)
        assert lookup(m, keys[1]) is LookupResult.HIT  # still cached as present
        pool.array[3:6] = 0
        assert not load(m, w, keys, [3, 4, 5])  # the job fails: nothing half-promoted
        c = m.get_stats().counters
        bad_count = c.get("checksum_failures", 0) + c.get("wrong_key_values", 0)
        assert bad_count == 1 and c["loaded_blocks"] == 2 and c["load_failures"] == 1
        assert lookup(m, keys[1]) is LookupResult.MISS  # the worker told the manager
        assert raw.is_exist(rkey) == 0  # removed: a later store rewrites it
        assert load(m, w, [keys[0], keys[2]], [6, 7])
        assert np.array_equal(pool.chunk(0), pool.chunk(6)) and np.array_equal(pool.chunk(2), pool.chunk(7))
        assert store(m, w, [keys[1]], [1]) and load(m, w, [keys[1]], [5])  # rewritten, served again
        assert np.array_equal(pool.chunk(1), pool.chunk(5))
    finally:
        tier.shutdown()


def test_damage_in_a_later_round_fails_the_job_once(mooncake, raw, prefix):
    """Rounds of one value each (batch_bytes = one chunk), checked behind the
    transfers: a bad value in the last round still fails the job, which is
    reported once, after every round was checked."""
    chunk = 8192
    tier, m, w, pool = make_tier(mooncake, prefix, num_chunks=12, chunk_bytes=chunk, batch_bytes=chunk)
    try:
        keys = keys_for(5, seed=21)
        fill(pool, range(5), seed=21)
        assert store(m, w, keys, list(range(5)))
        rkey = tier.keyspace.redis_key(keys[4])
        v = bytearray(raw.get(rkey))
        v[5] ^= 1
        _replace(raw, rkey, bytes(v))
        spec = m.prepare_load(keys, CTX)
        assert w.submit_load(91, spec, CPULoadStoreSpec(list(range(5, 10))))
        w.wait({91})
        done = [r for r in w.get_finished() if r.job_id == 91]
        m.complete_load(keys, CTX)
        assert len(done) == 1 and not done[0].success
        c = m.get_stats().counters
        assert c["checksum_failures"] == 1 and c["loaded_blocks"] == 4 and c["load_failures"] == 1
        assert np.array_equal(pool.array[0:4], pool.array[5:9])
    finally:
        tier.shutdown()


def test_mac_refuses_a_value_without_it(mooncake, prefix, tmp_path, monkeypatch):
    """With a shared secret, a value stored by a client without it is refused (BAD_MAC)."""
    monkeypatch.setenv("KVO_MC_MAC", "a-secret-of-at-least-16-bytes")
    plain, m1, w1, p1 = make_tier(mooncake, prefix, num_chunks=4, chunk_bytes=4096)
    maced, m2, w2, p2 = make_tier(mooncake, prefix, num_chunks=4, chunk_bytes=4096, mac_key_env="KVO_MC_MAC")
    try:
        keys = keys_for(2, seed=5)
        fill(p1, range(2), seed=5)
        assert store(m1, w1, keys, [0, 1])
        assert not load(m2, w2, keys, [2, 3])
        assert m2.get_stats().counters["mac_failures"] == 2
        fill(p2, range(2), seed=5)
        assert store(m2, w2, keys, [0, 1]) and load(m2, w2, keys, [2, 3])
        assert np.array_equal(p2.chunk(0), p2.chunk(2))
    finally:
        plain.shutdown()
        maced.shutdown()


def test_damage_in_two_pieces_of_one_round(mooncake, raw, prefix):
    """A round of 8 MiB is checked in pieces on several threads: bad values in
    two pieces are both counted and removed, the job is reported once,
    failed, and the good values are exact."""
    chunk, n = 1 << 20, 8
    tier, m, w, pool = make_tier(mooncake, prefix, num_chunks=2 * n, chunk_bytes=chunk, io_threads=4)
    try:
        keys = keys_for(n, seed=22)
        fill(pool, range(n), seed=22)
        assert store(m, w, keys, list(range(n)))
        for bad in (1, 6):  # the first and the last of four pieces of two values
            rkey = tier.keyspace.redis_key(keys[bad])
            v = bytearray(raw.get(rkey))
            v[bad * 1000] ^= 1
            _replace(raw, rkey, bytes(v))
        spec = m.prepare_load(keys, CTX)
        assert w.submit_load(92, spec, CPULoadStoreSpec(list(range(n, 2 * n))))
        w.wait({92})
        done = w.get_finished()
        m.complete_load(keys, CTX)
        assert [(r.job_id, r.success) for r in done] == [(92, False)]
        c = m.get_stats().counters
        assert c["checksum_failures"] == 2 and c["loaded_blocks"] == n - 2 and c["load_failures"] == 2
        assert all(raw.is_exist(tier.keyspace.redis_key(keys[b])) == 0 for b in (1, 6))
        good = [j for j in range(n) if j not in (1, 6)]
        assert all(np.array_equal(pool.chunk(j), pool.chunk(n + j)) for j in good)
    finally:
        tier.shutdown()
