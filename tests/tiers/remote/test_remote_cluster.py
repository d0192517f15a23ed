"""Cluster mode against a real 3-node Redis Cluster: keys spread over the
nodes, each node gets its own data connection, bytes come back exact."""

from __future__ import annotations

import numpy as np
import pytest
import redis
from redis.cluster import RedisCluster

from kvoffload.abstractions import LookupResult
from remote_helpers import fill, keys_for, load, lookup, make_tier, store

pytestmark = [pytest.mark.redis, pytest.mark.slow]


def test_cluster_round_trip(redis_cluster, prefix):
    url = f"redis://127.0.0.1:{redis_cluster[0].port}/0"
    tier, m, w, pool = make_tier(url, prefix, num_chunks=64, chunk_bytes=16 << 10, cluster=True)
    try:
        assert isinstance(tier.client, RedisCluster)
        keys = keys_for(32, seed=50)
        fill(pool, range(32), seed=50)
        assert store(m, w, keys, list(range(32)))
        per_node = [redis.Redis(port=n.port).dbsize() for n in redis_cluster]
        assert sum(per_node) >= 32 and sum(1 for c in per_node if c) >= 2  # spread across nodes
        m.reset_cache()
        assert [lookup(m, k) for k in keys] == [LookupResult.HIT] * 32
        assert lookup(m, keys_for(1, seed=51)[0]) is LookupResult.MISS
        assert load(m, w, keys, list(range(32, 64)))
        assert np.array_equal(pool.array[:32], pool.array[32:])
    finally:
        tier.shutdown()


def test_cluster_mode_against_a_standalone_server_is_a_clear_error(redis_server, prefix):
    from kvoffload.config import ConfigError

    with pytest.raises(ConfigError, match="remote.cluster"):
        make_tier(redis_server.url, prefix, cluster=True)
