"""How the worker schedules: a large load split over several connections
(one job, one result), loads ahead of queued stores, and every network wait
of the raw GET path bounded by the socket timeout (real redis-server)."""

from __future__ import annotations


import numpy as np
import pytest
import redis

from kvoffload.abstractions import CPULoadStoreSpec
from kvoffload.tiers.redis.resp import RawConnection
from kvoffload.tiers.remote.network import NETWORK_ERRORS
from kvoffload.tiers.remote.value import HEADER_BYTES
from remote_helpers import CTX, fill, keys_for, load, make_tier, store, wait_until

pytestmark = pytest.mark.redis

MiB = 1 << 20


def _clients_whose_last_command_was(r: redis.Redis, cmd: str) -> int:
    return sum(c["cmd"] == cmd for c in r.client_list())


def test_large_load_is_split_over_connections(fresh_server, prefix):
    srv = fresh_server.start()
    tier, m, w, pool = make_tier(srv.url, prefix, num_chunks=16, chunk_bytes=MiB, io_threads=3)
    try:
        keys = keys_for(6, seed=40)
        fill(pool, range(6), seed=40)
        assert store(m, w, keys, list(range(6)))
        assert load(m, w, keys, list(range(8, 14)))
        assert np.array_equal(pool.array[0:6], pool.array[8:14])
        # one job of 6 MiB, three threads: each moved a part on its own connection
        assert _clients_whose_last_command_was(redis.Redis(port=srv.port), "get") == 3
        assert m.get_stats().counters["loaded_blocks"] == 6
    finally:
        tier.shutdown()
        pool.close()


def test_a_bad_part_fails_the_whole_split_load_once(fresh_server, prefix):
    srv = fresh_server.start()
    tier, m, w, pool = make_tier(srv.url, prefix, num_chunks=16, chunk_bytes=MiB, io_threads=3)
    try:
        keys = keys_for(6, seed=41)
        fill(pool, range(6), seed=41)
        assert store(m, w, keys, list(range(6)))
        r = redis.Redis(port=srv.port)
        r.setrange(tier.keyspace.redis_key(keys[4]), HEADER_BYTES + 7, b"\xff\x00")
        spec = m.prepare_load(keys, CTX)
        assert w.submit_load(77, spec, CPULoadStoreSpec(list(range(8, 14))))
        w.wait({77})
        results = [x for x in w.get_finished() if x.job_id == 77]
        m.complete_load(keys, CTX)
        assert len(results) == 1 and not results[0].success and results[0].transfer_size == 0
        c = m.get_stats().counters
        assert c["checksum_failures"] == 1 and c["loaded_blocks"] == 5
    finally:
        tier.shutdown()
        pool.close()


def test_loads_go_before_queued_stores(fresh_server, prefix):
    srv = fresh_server.start()
    tier, m, w, pool = make_tier(srv.url, prefix, num_chunks=8, chunk_bytes=64 << 10, io_threads=1,
                                 socket_timeout_s=120.0)
    try:
        stored = keys_for(2, seed=42)
        fill(pool, range(2), seed=42)
        assert store(m, w, stored, [0, 1])
        load_spec = m.prepare_load(stored, CTX)
        first = m.prepare_store(keys_for(1, seed=43), CTX).store_spec
        second = m.prepare_store(keys_for(1, seed=44), CTX).store_spec
        srv.pause()  # the thread's first job waits on the server
        try:
            assert w.submit_store(1, CPULoadStoreSpec([2]), first)
            wait_until(lambda: not w._stores, "the IO thread took the first store")  # noqa: SLF001
            assert w.submit_store(2, CPULoadStoreSpec([3]), second)
            assert w.submit_load(3, load_spec, CPULoadStoreSpec([4, 5]))
        finally:
            srv.resume()
        w.wait({1, 2, 3})
        done = w.get_finished()
        assert [x.job_id for x in done] == [1, 3, 2] and all(x.success for x in done)
        assert np.array_equal(pool.array[0:2], pool.array[4:6])
    finally:
        tier.shutdown()
        pool.close()


def test_raw_get_from_a_stopped_server_raises(fresh_server):
    """No reply (a hung server): a network error after the socket timeout, never a hang."""
    srv = fresh_server.start()
    r = redis.Redis(port=srv.port, socket_timeout=0.5)
    rc = RawConnection(r.connection_pool.make_connection())
    try:
        value = memoryview(bytearray(8 * MiB))
        assert rc.set_many([b"big"], [value]) == [True]
        srv.pause()
        try:
            with pytest.raises(NETWORK_ERRORS):
                rc.get_many_into([b"big", b"big"], [value, memoryview(bytearray(8 * MiB))], 64 * MiB)
        finally:
            srv.resume()
    finally:
        rc.close()
