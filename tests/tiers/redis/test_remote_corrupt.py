"""A partial, foreign or corrupted value is a miss, counted, never served."""

from __future__ import annotations

import numpy as np
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvoffload.abstractions import LookupResult
from kvoffload.tiers.redis import resp
from kvoffload.tiers.redis.resp import RawConnection
from kvoffload.tiers.remote.value import HEADER_BYTES
from remote_helpers import fill, keys_for, load, lookup, make_tier, store

pytestmark = pytest.mark.redis


def _damage(r: redis.Redis, rkey: bytes, how: str) -> None:
    if how == "flip_payload":
        v = bytearray(r.get(rkey))
        v[HEADER_BYTES + 1000] ^= 0x40
        r.set(rkey, bytes(v))
    elif how == "flip_header":
        r.setrange(rkey, 0, b"KVOX")
    elif how == "truncate":
        r.set(rkey, r.get(rkey)[:-1])
    elif how == "foreign":
        r.set(rkey, b"hello, not a KV chunk")
    elif how == "empty":
        r.set(rkey, b"")


@pytest.mark.parametrize("how", ["flip_payload", "flip_header", "truncate", "foreign", "empty"])
def test_damaged_value_is_a_miss(redis_server, prefix, how):
    tier, m, w, pool = make_tier(redis_server.url, prefix, num_chunks=8, chunk_bytes=8192)
    try:
        keys = keys_for(3, seed=20)
        fill(pool, range(3), seed=20)
        assert store(m, w, keys, [0, 1, 2])
        r = redis.Redis.from_url(redis_server.url)
        _damage(r, tier.keyspace.redis_key(keys[1]), how)
        assert lookup(m, keys[1]) is LookupResult.HIT  # still cached as present
        assert not load(m, w, keys, [3, 4, 5])  # the job fails: nothing half-promoted
        c = m.get_stats().counters
        assert c["checksum_failures"] == 1 and c["loaded_blocks"] == 2
        assert lookup(m, keys[1]) is LookupResult.MISS  # the worker told the manager
        assert r.exists(tier.keyspace.redis_key(keys[1])) == 0  # deleted, a later store rewrites it
        # the undamaged neighbours still load, and the connection is still in step
        assert load(m, w, [keys[0], keys[2]], [6, 7])
        assert np.array_equal(pool.chunk(0), pool.chunk(6)) and np.array_equal(pool.chunk(2), pool.chunk(7))
    finally:
        tier.shutdown()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.integers(1, 20_000), min_size=1, max_size=12), data=st.data())
def test_raw_get_never_serves_wrong_bytes(redis_server, sizes, data):
    """Whatever is stored under a key, GET answers OK only with the exact payload."""
    r = redis.Redis.from_url(redis_server.url)
    rc = RawConnection(r.connection_pool.make_connection())
    try:
        rng = np.random.default_rng(len(sizes))
        payloads = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
        keys = [b"hyp:%d" % i for i in range(len(sizes))]
        assert all(rc.set_many(keys, [memoryview(p) for p in payloads]))
        damaged = set()
        for i in range(len(keys)):
            if data.draw(st.booleans()):
                v = bytearray(r.get(keys[i]))
                pos = data.draw(st.integers(0, len(v) - 1))
                v[pos] ^= 1 << data.draw(st.integers(0, 7))
                r.set(keys[i], bytes(v))
                damaged.add(i)
        dsts = [memoryview(bytearray(n)) for n in sizes]
        status = rc.get_many_into(keys, dsts, batch_bytes=data.draw(st.integers(1, 50_000)))
        for i, s in enumerate(status):
            if i in damaged:
                assert s == resp.CORRUPT
            else:
                assert s == resp.OK and bytes(dsts[i]) == payloads[i]
    finally:
        rc.close()


def test_value_evicted_after_lookup_is_a_miss(redis_server, prefix):
    """The server dropped the value (eviction, TTL, flush) after we learned it was there."""
    tier, m, w, pool = make_tier(redis_server.url, prefix, num_chunks=8, chunk_bytes=8192)
    try:
        keys = keys_for(2, seed=21)
        assert store(m, w, keys, [0, 1])
        redis.Redis.from_url(redis_server.url).delete(tier.keyspace.redis_key(keys[0]))
        assert lookup(m, keys[0]) is LookupResult.HIT  # cached answer
        assert not load(m, w, keys, [2, 3])
        c = m.get_stats().counters
        assert c["load_misses"] == 1 and c.get("checksum_failures", 0) == 0
        assert lookup(m, keys[0]) is LookupResult.MISS
    finally:
        tier.shutdown()
