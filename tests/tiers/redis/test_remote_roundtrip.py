"""Round trips through a real redis-server: bytes come back exactly, lookups
go RETRY -> HIT/MISS without blocking, namespaces and prefixes stay apart."""

from __future__ import annotations

import numpy as np
import pytest
import redis

from kvoffload.abstractions import Locality, LookupResult, Medium
from kvoffload.tiers.base import Namespace
from kvoffload.tiers.redis import RemoteTier
from kvoffload.tiers.remote.value import HEADER_BYTES
from remote_helpers import CTX, fill, keys_for, load, lookup, make_tier, store

pytestmark = pytest.mark.redis

HIT, MISS, RETRY, HIT_PENDING = (LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY,
                                 LookupResult.HIT_PENDING)


@pytest.mark.parametrize("chunk_bytes", [4096, 64 << 10, 1 << 20, 100_003])
def test_round_trip_bit_exact(redis_server, prefix, chunk_bytes):
    tier, m, w, pool = make_tier(redis_server.url, prefix, num_chunks=16, chunk_bytes=chunk_bytes)
    try:
        keys = keys_for(8)
        fill(pool, range(8), seed=1)
        assert store(m, w, keys, list(range(8)))
        assert all(lookup(m, k) is HIT for k in keys)
        assert load(m, w, keys, list(range(8, 16)))
        n = pool.used_chunk_bytes
        assert np.array_equal(pool.array[:8, :n], pool.array[8:16, :n])
        stats = m.get_stats()
        assert stats.medium is Medium.CPU and stats.locality is Locality.REMOTE
        assert stats.counters["stored_blocks"] == 8 and stats.counters["loaded_blocks"] == 8
        assert stats.counters["loaded_bytes"] == 8 * n
        # on the server: one value per key, header + payload
        raw = redis.Redis.from_url(redis_server.url).get(tier.keyspace.redis_key(keys[0]))
        assert len(raw) == HEADER_BYTES + n
    finally:
        tier.shutdown()


def test_unknown_key_retry_then_miss(redis_server, prefix):
    tier, m, _w, _pool = make_tier(redis_server.url, prefix)
    try:
        key = keys_for(1, seed=99)[0]
        assert m.lookup(key, CTX) is RETRY  # never waits on the network
        assert m.has_pending_work()
        assert lookup(m, key) is MISS
        assert m.lookup(key, CTX) is MISS  # cached answer: no second check
        assert not m.has_pending_work()
        c = m.get_stats().counters
        assert c["misses"] == 2 and c["retries"] >= 1
    finally:
        tier.shutdown()


def test_another_engine_sees_stores_after_check(redis_server, prefix):
    """Engine B asked before A stored (cached MISS); once the cache expires B sees A's block."""
    a = make_tier(redis_server.url, prefix)
    b = make_tier(redis_server.url, prefix, miss_cache_s=0.05)
    try:
        key = keys_for(1, seed=5)
        assert lookup(b[1], key[0]) is MISS
        fill(a[3], [0], seed=5)
        assert store(a[1], a[2], key, [0])
        import time
        time.sleep(0.06)
        assert lookup(b[1], key[0]) is HIT
        assert load(b[1], b[2], key, [1])
        assert np.array_equal(a[3].chunk(0), b[3].chunk(1))
    finally:
        a[0].shutdown()
        b[0].shutdown()


def test_batched_checks_one_pipeline(redis_server, prefix):
    """Keys looked up in one step go out together; prefetch warms a whole prefix."""
    tier, m, w, pool = make_tier(redis_server.url, prefix)
    try:
        keys = keys_for(20, seed=7)
        fill(pool, range(10), seed=7)
        assert store(m, w, keys[:10], list(range(10)))
        m.reset_cache()
        m.prefetch(keys)
        assert all(m.lookup(k, CTX) is RETRY for k in keys)
        answers = [lookup(m, k) for k in keys]
        assert answers == [HIT] * 10 + [MISS] * 10
    finally:
        tier.shutdown()


def test_in_flight_store_is_hit_pending_and_present_keys_skipped(redis_server, prefix):
    tier, m, w, pool = make_tier(redis_server.url, prefix)
    try:
        keys = keys_for(4, seed=8)
        out = m.prepare_store(keys, CTX)
        assert out.keys_to_store == keys and out.evicted_keys == []
        assert m.lookup(keys[0], CTX) is HIT_PENDING
        m.complete_store(keys, CTX, success=False)
        assert m.lookup(keys[0], CTX) is RETRY  # not stored: unknown again
        m.on_schedule_end(None)
        fill(pool, range(4), seed=8)
        assert store(m, w, keys[:2], [0, 1])
        out = m.prepare_store(keys, CTX)
        assert out.keys_to_store == keys[2:]  # the first two are known present
        m.complete_store(keys, CTX, success=False)
    finally:
        tier.shutdown()


def test_namespaces_and_prefixes_never_mix(redis_server, prefix):
    tier, m, w, pool = make_tier(redis_server.url, prefix)
    ns_other = Namespace(model="other", dtype="bf16", layout="canon", block_size=16,
                         chunk_bytes=pool.used_chunk_bytes)
    other_ns = RemoteTier({"url": redis_server.url, "key_prefix": prefix}, ns_other)
    other_prefix = RemoteTier({"url": redis_server.url, "key_prefix": prefix + "x"}, tier.namespace)
    try:
        keys = keys_for(2, seed=9)
        fill(pool, range(2), seed=9)
        assert store(m, w, keys, [0, 1])
        assert lookup(m, keys[0]) is HIT
        assert lookup(other_ns.get_manager(), keys[0]) is MISS
        assert lookup(other_prefix.get_manager(), keys[0]) is MISS
    finally:
        for t in (tier, other_ns, other_prefix):
            t.shutdown()


def test_unix_socket_url(redis_server, prefix):
    tier, m, w, pool = make_tier(redis_server.unix_url, prefix)
    try:
        keys = keys_for(3, seed=10)
        fill(pool, range(3), seed=10)
        assert store(m, w, keys, [0, 1, 2])
        assert lookup(m, keys[2]) is HIT
        assert load(m, w, keys, [3, 4, 5])
        assert np.array_equal(pool.array[:3], pool.array[3:6])
    finally:
        tier.shutdown()


def test_ttl_is_set_when_asked(redis_server, prefix):
    tier, m, w, pool = make_tier(redis_server.url, prefix, ttl_s=300)
    try:
        keys = keys_for(1, seed=11)
        assert store(m, w, keys, [0])
        ttl = redis.Redis.from_url(redis_server.url).ttl(tier.keyspace.redis_key(keys[0]))
        assert 0 < ttl <= 300
    finally:
        tier.shutdown()


def test_events_only_when_enabled(redis_server, prefix):
    tier, m, w, pool = make_tier(redis_server.url, prefix)
    on = RemoteTier({"url": redis_server.url, "key_prefix": prefix}, tier.namespace, enable_events=True)
    try:
        keys = keys_for(2, seed=12)
        assert store(m, w, keys, [0, 1])
        assert list(m.take_events()) == []
        m2, w2 = on.get_manager(), on.get_worker(pool)
        keys2 = keys_for(2, seed=13)
        assert store(m2, w2, keys2, [0, 1])
        (ev,) = list(m2.take_events())
        assert ev.keys == keys2 and not ev.removed and ev.locality is Locality.REMOTE and ev.ownership == "remote"
    finally:
        tier.shutdown()
        on.shutdown()


def test_one_retry_checks_the_whole_prefix(redis_server, prefix):
    """The scheduler stops at the first non-HIT; the request's key positions
    let the first RETRY check every later block too (one round trip)."""
    from kvoffload.abstractions import ReqContext

    tier, m, w, pool = make_tier(redis_server.url, prefix)
    try:
        keys = keys_for(12, seed=14)
        assert store(m, w, keys[:8], list(range(8)))
        m.reset_cache()
        ctx = ReqContext("prefix")
        for i, k in enumerate(keys):
            ctx.set_offload_key_position(k, (i + 1) * 16)
        assert m.lookup(keys[0], ctx) is RETRY
        m.get_stats()
        while m.has_pending_work():
            m.on_schedule_end(None)
        answers = [m.lookup(k, ctx) for k in keys]
        assert answers == [HIT] * 8 + [MISS] * 4
        assert m.get_stats().counters.get("retries", 0) == 0
    finally:
        tier.shutdown()
