"""Cluster mode against a real 3-node Redis Cluster: keys spread over the
nodes, each node gets its own data connection, bytes come back exact."""

from __future__ import annotations

import time

import numpy as np
import pytest
import redis
from redis.cluster import RedisCluster

from kvoffload.abstractions import LookupResult
from remote_helpers import fill, keys_for, load, lookup, make_tier, store, wait_until

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


@pytest.mark.timeout(600)
def test_lookups_hit_again_after_the_whole_cluster_was_down(redis_cluster, prefix):
    """Every node down makes redis-py raise RedisClusterUnreachableError (not a
    RedisError): lookups are misses meanwhile, and the lookup thread lives on,
    so lookups HIT again once the cluster is back. Last in this module: the
    cluster is restarted (empty, same ports)."""
    url = f"redis://127.0.0.1:{redis_cluster[0].port}/0"
    tier, m, w, pool = make_tier(url, prefix, num_chunks=8, chunk_bytes=16 << 10, cluster=True,
                                 connect_timeout_s=2.0, socket_timeout_s=2.0, lookup_deadline_s=2.0,
                                 backoff_max_s=0.2)
    try:
        keys = keys_for(4, seed=52)
        fill(pool, range(4), seed=52)
        assert store(m, w, keys, [0, 1, 2, 3])
        for n in redis_cluster:
            n.kill()
        for i in range(4):  # several rounds fail: the first used to kill the thread
            assert lookup(m, keys_for(1, seed=53 + i)[0]) is LookupResult.MISS
            time.sleep(0.3)
        for n in redis_cluster:
            n.start()  # its nodes.conf brings the same cluster back, without data
        wait_until(lambda: all(redis.Redis(port=n.port).cluster("info").get("cluster_state") == "ok"
                               for n in redis_cluster), "the cluster back to ok")
        wait_until(lambda: store(m, w, keys, [0, 1, 2, 3]), "a store after the restart")
        m.reset_cache()
        wait_until(lambda: [lookup(m, k) for k in keys] == [LookupResult.HIT] * 4, "HITs after the restart")
        assert load(m, w, keys, [4, 5, 6, 7])
        assert np.array_equal(pool.array[:4], pool.array[4:])
    finally:
        tier.shutdown()
