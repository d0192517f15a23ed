"""A value is served only under the key (and namespace) it was stored
under, only with the shared secret when one is configured, and keys of
another type are cleared, not retried forever. Against a real server,
with the damage done the way someone with write access would do it."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import redis
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.abstractions import LookupResult
from kvoffload.config import ConfigError
from kvoffload.tiers.base import Namespace
from kvoffload.tiers.host_pool import HostPool
from kvoffload.tiers.redis import RemoteConfig, RemoteTier
from kvoffload.tiers.remote.value import HEADER_BYTES, OK, WRONG_KEY, ValueCodec, key_hash
from remote_helpers import fill, keys_for, load, lookup, make_tier, store, undeclared

pytestmark = pytest.mark.redis

SECRET = "correct horse battery staple, 2026"


def _counters(m) -> dict:
    stats = m.get_stats()
    assert not undeclared(stats)  # vLLM exports only declared series
    return stats.counters


def test_value_copied_under_another_key_is_a_deleted_miss(redis_server, prefix):
    tier, m, w, pool = make_tier(redis_server.url, prefix, num_chunks=8, chunk_bytes=8192)
    try:
        keys = keys_for(2, seed=60)
        fill(pool, range(2), seed=60)
        assert store(m, w, keys, [0, 1])
        r = redis.Redis.from_url(redis_server.url)
        a, b = (tier.keyspace.redis_key(k) for k in keys)
        r.set(b, r.get(a))  # a valid value, under the wrong key
        assert not load(m, w, [keys[1]], [2])
        c = _counters(m)
        assert c["wrong_key_values"] == 1 and c.get("loaded_blocks", 0) == 0
        assert r.exists(b) == 0  # deleted: a later store rewrites it
        assert lookup(m, keys[1]) is LookupResult.MISS
        assert load(m, w, [keys[0]], [3]) and np.array_equal(pool.chunk(0), pool.chunk(3))
    finally:
        tier.shutdown()


def test_another_namespaces_values_are_not_served(redis_server, prefix):
    pool = HostPool(16, 8192)
    ns = [Namespace(model=m, dtype="bf16", layout="canon", block_size=16, chunk_bytes=pool.used_chunk_bytes)
          for m in ("model-a", "model-b")]
    ta, tb = (RemoteTier({"url": redis_server.url, "key_prefix": prefix}, n) for n in ns)
    try:
        ma, wa, mb, wb = ta.get_manager(), ta.get_worker(pool), tb.get_manager(), tb.get_worker(pool)
        keys = keys_for(6, seed=61)
        fill(pool, range(6), seed=61)
        assert store(ma, wa, keys, list(range(6)))
        r = redis.Redis.from_url(redis_server.url)
        for k in keys:  # model-a's values copied under model-b's keys
            r.set(tb.keyspace.redis_key(k), r.get(ta.keyspace.redis_key(k)))
        assert [lookup(mb, k) for k in keys] == [LookupResult.HIT] * 6  # they exist...
        assert not load(mb, wb, keys, list(range(6, 12)))  # ...but are not served
        assert _counters(mb)["wrong_key_values"] == 6
        assert sum(r.exists(tb.keyspace.redis_key(k)) for k in keys) == 0
        assert load(ma, wa, keys, list(range(6, 12)))  # model-a's own still load
        assert np.array_equal(pool.array[0:6], pool.array[6:12])
    finally:
        ta.shutdown()
        tb.shutdown()


def test_version_1_value_is_a_miss_not_an_error(redis_server, prefix):
    """Values from before the key binding: same magic, old layout."""
    tier, m, w, pool = make_tier(redis_server.url, prefix, num_chunks=4, chunk_bytes=8192)
    try:
        key = keys_for(1, seed=62)[0]
        payload = bytes(pool.used_chunk_bytes)
        v1 = struct.pack("<4sHHQQ", b"KVOF", 1, 0, len(payload), xxhash.xxh3_64_intdigest(payload)) + payload
        r = redis.Redis.from_url(redis_server.url)
        r.set(tier.keyspace.redis_key(key), v1)
        assert lookup(m, key) is LookupResult.HIT
        assert not load(m, w, [key], [0])
        assert _counters(m)["checksum_failures"] == 1
        assert r.exists(tier.keyspace.redis_key(key)) == 0
    finally:
        tier.shutdown()


def test_wrong_type_key_is_a_counted_miss_and_cleared(redis_server, prefix):
    tier, m, w, pool = make_tier(redis_server.url, prefix, num_chunks=8, chunk_bytes=8192, miss_cache_s=0.01)
    try:
        keys = keys_for(2, seed=63)
        r = redis.Redis.from_url(redis_server.url)
        r.rpush(tier.keyspace.redis_key(keys[0]), b"x", b"y")
        r.hset(tier.keyspace.redis_key(keys[1]), b"f", b"v")
        assert [lookup(m, k) for k in keys] == [LookupResult.HIT] * 2  # EXISTS says yes
        assert not load(m, w, keys, [0, 1])
        assert _counters(m)["wrong_type_keys"] == 2
        assert r.exists(*(tier.keyspace.redis_key(k) for k in keys)) == 0
        m.reset_cache()  # a new request asks again: now an ordinary miss, not another failed load
        assert [lookup(m, k) for k in keys] == [LookupResult.MISS] * 2
        fill(pool, range(2), seed=63)
        assert store(m, w, keys, [0, 1]) and load(m, w, keys, [2, 3])
        assert np.array_equal(pool.array[0:2], pool.array[2:4])
    finally:
        tier.shutdown()


# -- shared secret ------------------------------------------------------------


@pytest.fixture
def key_file(tmp_path):
    p = tmp_path / "mac.key"
    p.write_text(SECRET + "\n")
    p.chmod(0o600)
    return str(p)


def test_mac_round_trip_and_forgeries(redis_server, prefix, key_file, tmp_path, monkeypatch):
    other = tmp_path / "other.key"
    other.write_text("another secret of enough length")
    monkeypatch.setenv("KVOFF_TEST_MAC", SECRET)
    tier, m, w, pool = make_tier(redis_server.url, prefix, num_chunks=16, chunk_bytes=8192, mac_key_file=key_file)
    # the same secret from the environment; no secret; another secret
    env_tier, em, ew, epool = make_tier(redis_server.url, prefix, num_chunks=16, chunk_bytes=8192,
                                    mac_key_env="KVOFF_TEST_MAC")
    plain, pm, pw, ppool = make_tier(redis_server.url, prefix, num_chunks=16, chunk_bytes=8192)
    wrong, xm, xw, _ = make_tier(redis_server.url, prefix, num_chunks=16, chunk_bytes=8192, mac_key_file=str(other))
    try:
        keys = keys_for(4, seed=64)
        fill(pool, range(4), seed=64)
        assert store(m, w, keys, [0, 1, 2, 3])
        assert load(em, ew, keys, [4, 5, 6, 7]) and np.array_equal(pool.array[0:4], epool.array[4:8])
        assert load(pm, pw, keys[:1], [0])  # no secret: the checksum still vouches for the bytes
        assert not load(xm, xw, keys[:1], [8])  # another secret: refused (and deleted)
        assert _counters(xm)["mac_failures"] == 1

        r = redis.Redis.from_url(redis_server.url)
        rk = tier.keyspace.redis_key(keys[1])
        # a forgery by someone without the secret: a well-formed value for this key, a made-up MAC
        payload = bytes(pool.used_chunk_bytes)
        head = struct.pack("<4sHHQQ", b"KVOF", 2, 1, len(payload), key_hash(rk))
        h = xxhash.xxh3_64(head)
        h.update(payload)
        r.set(rk, head + struct.pack("<Q", h.intdigest()) + b"\x01" * 16 + payload)
        # a value stored without the secret, under a key the secret holders read
        fill(ppool, [9], seed=65)
        assert store(pm, pw, [keys[2]], [9])
        assert not load(m, w, keys[1:3], [10, 11])
        assert _counters(m)["mac_failures"] == 2
        assert r.exists(rk, tier.keyspace.redis_key(keys[2])) == 0
        assert load(m, w, [keys[3]], [12]) and np.array_equal(pool.chunk(3), pool.chunk(12))
    finally:
        for t in (tier, env_tier, plain, wrong):
            t.shutdown()


def test_mac_key_settings_are_checked_and_never_shown(tmp_path, monkeypatch, key_file):
    ns = Namespace(model="tiny", dtype="bf16", layout="canon", block_size=16, chunk_bytes=4096)
    short = tmp_path / "short.key"
    short.write_text("too short")
    monkeypatch.delenv("KVOFF_TEST_UNSET", raising=False)
    cases = [({"mac_key_file": str(short)}, "at least 16 bytes"),
             ({"mac_key_file": str(tmp_path / "missing")}, "mac_key_file"),
             ({"mac_key_env": "KVOFF_TEST_UNSET"}, "not set"),
             ({"mac_key_file": key_file, "mac_key_env": "X"}, "at most one"),
             ({"mac_key_file": key_file, "mac_algorithm": "md5"}, "mac_algorithm")]
    for conf, msg in cases:
        with pytest.raises(ConfigError, match=msg) as e:
            RemoteTier({"url": "redis://127.0.0.1:1/0", **conf}, ns)
        assert "too short" not in str(e.value)
    cfg = RemoteConfig(mac_key_file=key_file)
    assert SECRET not in repr(cfg) and cfg.load_mac_key() is not None and SECRET.encode() not in cfg.load_mac_key()


def test_blake3_mac(redis_server, prefix, key_file):
    pytest.importorskip("blake3")
    tier, m, w, pool = make_tier(redis_server.url, prefix, num_chunks=8, chunk_bytes=8192, mac_key_file=key_file,
                                 mac_algorithm="blake3")
    b2, bm, bw, _ = make_tier(redis_server.url, prefix, num_chunks=8, chunk_bytes=8192, mac_key_file=key_file)
    try:
        keys = keys_for(2, seed=66)
        fill(pool, range(2), seed=66)
        assert store(m, w, keys, [0, 1])
        assert load(m, w, keys[:1], [2]) and np.array_equal(pool.chunk(0), pool.chunk(2))
        assert not load(bm, bw, keys[1:], [3])  # same secret, other algorithm: refused
        assert _counters(bm)["mac_failures"] == 1
    finally:
        tier.shutdown()
        b2.shutdown()


@settings(max_examples=200, deadline=None)
@given(payload=st.binary(min_size=1, max_size=4096), key=st.binary(min_size=1, max_size=80),
       other=st.binary(min_size=1, max_size=80), bit=st.integers(0, 1 << 20), mac=st.booleans())
def test_codec_accepts_only_the_exact_value_under_its_own_key(payload, key, other, bit, mac):
    codec = ValueCodec(bytes(range(32)) if mac else None)
    value = bytearray(codec.header(key, payload) + payload)
    hdr, body = value[:HEADER_BYTES], memoryview(value)[HEADER_BYTES:]
    assert codec.shape_ok(hdr, len(payload)) and codec.verify(key, hdr, body) == OK
    if other != key:
        assert codec.verify(other, hdr, body) == WRONG_KEY
    value[(bit // 8) % len(value)] ^= 1 << (bit % 8)  # one flipped bit, anywhere
    hdr, body = value[:HEADER_BYTES], memoryview(value)[HEADER_BYTES:]
    assert not (codec.shape_ok(hdr, len(payload)) and codec.verify(key, hdr, body) == OK)
