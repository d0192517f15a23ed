"""Server down, hung or restarted: operations finish (bounded by socket
timeouts and back-off, enforced here by pytest-timeout) with misses and
dropped stores, counted; hits resume once the server is back. Bad
credentials fail at start-up with a clear message."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest
import redis

from kvoffload.abstractions import LookupResult
from kvoffload.config import ConfigError
from kvoffload.tiers.redis.server import LocalServer, free_port
from remote_helpers import CTX, fill, keys_for, load, lookup, make_tier, store, total, undeclared, wait_until

pytestmark = pytest.mark.redis

# Short enough to keep a dead server's cost small, long enough that a live one
# on a loaded machine does not time out (a killed server refuses at once).
FAST_FAIL = dict(connect_timeout_s=2.0, socket_timeout_s=2.0, lookup_deadline_s=2.0, backoff_initial_s=0.02,
                 backoff_max_s=0.2, lookup_cache_s=0.05, miss_cache_s=0.05)


def _engine_step(m, w, pool, i: int, prev_keys):
    """One request: look up the previous request's blocks, load the hits, store new blocks."""
    hits = [k for k in prev_keys if lookup(m, k) is LookupResult.HIT]
    loaded = load(m, w, hits, list(range(8, 8 + len(hits)))) if hits else False
    keys = keys_for(4, seed=1000 + i)
    fill(pool, range(4), seed=1000 + i)
    stored = store(m, w, keys, [0, 1, 2, 3])
    return keys, len(hits), loaded, stored


@pytest.mark.timeout(600)
def test_kill_mid_run_then_restart(fresh_server, prefix):
    srv = fresh_server.start()
    tier, m, w, pool = make_tier(srv.url, prefix, num_chunks=16, chunk_bytes=32 << 10, **FAST_FAIL)
    try:
        prev, before, after = [], [], []
        for i in range(30):
            if i == 15:
                srv.kill()
            prev, nhits, loaded, stored = _engine_step(m, w, pool, i, prev)
            (before if i < 15 else after).append((nhits, loaded, stored))
        # up: every request hit the previous one's blocks and stored its own
        assert all(h == 4 and ld and st for h, ld, st in before[1:])
        # down: the run went on; no stores landed, no loads succeeded
        assert not any(st for _, _, st in after) and not any(ld for _, ld, _ in after)
        stats = [m.get_stats()]
        assert total(stats, "stores_refused") + total(stats, "store_failures") >= 4 * 15
        assert total(stats, "misses") > 0
        assert stats[0].gauges["server_up"] == 0.0
        assert not undeclared(stats[0])  # an outage's counters reach vLLM's metrics too

        srv.start()  # same port, empty (no persistence)
        probe = keys_for(1, seed=999)
        wait_until(lambda: store(m, w, probe, [4]), "a store after the restart")  # back-off over, reconnected
        resumed = []
        prev = []
        for i in range(30, 36):
            prev, nhits, loaded, stored = _engine_step(m, w, pool, i, prev)
            resumed.append((nhits, loaded, stored))
        assert all(st for _, _, st in resumed)
        assert all(h == 4 and ld for h, ld, _ in resumed[2:])  # hits resumed
        keys = keys_for(4, seed=1000 + 35)
        assert load(m, w, keys, [8, 9, 10, 11])
        assert np.array_equal(pool.array[8:12], pool.array[0:4])
        stats = m.get_stats()
        assert stats.counters.get("reconnects", 0) >= 1 and stats.gauges["server_up"] == 1.0
        assert not undeclared(stats)
    finally:
        tier.shutdown()


@pytest.mark.timeout(600)
def test_hung_server_times_out_then_recovers(fresh_server, prefix):
    """SIGSTOP: the server accepts nothing and answers nothing (the 'slow' case)."""
    srv = fresh_server.start()
    tier, m, w, pool = make_tier(srv.url, prefix, num_chunks=8, chunk_bytes=16 << 10, **FAST_FAIL)
    try:
        keys = keys_for(2, seed=31)
        fill(pool, range(2), seed=31)
        assert store(m, w, keys, [0, 1])
        srv.pause()
        try:
            m.reset_cache()
            assert lookup(m, keys[0]) is LookupResult.MISS  # check timed out -> back-off -> miss
            assert not store(m, w, keys_for(2, seed=32), [0, 1])
            assert not load(m, w, keys, [2, 3])
        finally:
            srv.resume()
        wait_until(lambda: lookup(m, keys[0]) is LookupResult.HIT, "a HIT after the server resumed")
        assert load(m, w, keys, [2, 3])
        assert np.array_equal(pool.array[0:2], pool.array[2:4])
    finally:
        tier.shutdown()


@pytest.mark.timeout(600)
def test_paused_server_delays_a_lookup_by_the_deadline_only(fresh_server, prefix):
    """SIGSTOP with a long socket timeout: only lookup_deadline_s bounds the
    wait. The lookup must answer MISS while the server is still stopped."""
    srv = fresh_server.start()
    tier, m, w, pool = make_tier(srv.url, prefix, num_chunks=8, chunk_bytes=16 << 10, socket_timeout_s=60.0,
                                 lookup_deadline_s=0.2, lookup_cache_s=30.0, miss_cache_s=0.05)
    try:
        keys = keys_for(3, seed=33)
        fill(pool, range(3), seed=33)
        assert store(m, w, keys, [0, 1, 2])
        m.reset_cache()
        srv.pause()
        try:
            # lookup() gives up (fails the test) after 45 s, below the 60 s socket timeout
            assert lookup(m, keys[0]) is LookupResult.MISS
            assert lookup(m, keys[1]) is LookupResult.MISS  # a new key does not queue behind the stuck check
            assert srv.proc.poll() is None  # still there, still stopped: the answers came without it
            stats = m.get_stats()
            assert stats.counters["lookup_timeouts"] >= 2 and not undeclared(stats)
        finally:
            srv.resume()
        # the check in flight completes once the server runs again; answers are HITs again
        wait_until(lambda: lookup(m, keys[2]) is LookupResult.HIT, "a HIT after the server resumed")
        assert lookup(m, keys[0]) is LookupResult.HIT
    finally:
        tier.shutdown()


@pytest.mark.timeout(300)
def test_unreachable_at_start_serves_misses(prefix):
    url = f"redis://127.0.0.1:{free_port()}/0"
    tier, m, w, pool = make_tier(url, prefix, **FAST_FAIL)
    try:
        assert not tier.reachable_at_start
        key = keys_for(1)[0]
        assert lookup(m, key) is LookupResult.MISS
        assert not store(m, w, [key], [0])
        assert not load(m, w, [key], [1])
        c = m.get_stats().counters
        assert c["misses"] >= 1 and c.get("stores_refused", 0) + c.get("store_failures", 0) >= 1
    finally:
        tier.shutdown()


def test_wrong_password_is_a_clear_startup_error(prefix):
    with LocalServer(password="s3cret-pw") as srv:
        url = f"redis://127.0.0.1:{srv.port}/0"
        with pytest.raises(ConfigError, match="authentication") as e:
            make_tier(url, prefix, password="wrong-pw")
        assert "wrong-pw" not in str(e.value) and "s3cret-pw" not in str(e.value)
        with pytest.raises(ConfigError, match="remote.password"):
            make_tier(url, prefix)  # no password at all
        with pytest.raises(ConfigError, match=r"\*\*\*"):  # the url's password is redacted
            make_tier(f"redis://:bad@127.0.0.1:{srv.port}/0", prefix)
        tier, m, w, pool = make_tier(url, prefix, password="s3cret-pw")  # the right one works
        try:
            assert store(m, w, keys_for(1), [0])
        finally:
            tier.shutdown()


def test_acl_user(prefix):
    with LocalServer() as srv:
        r = redis.Redis(port=srv.port)
        r.acl_setuser("kv", enabled=True, passwords=["+kvpw"], keys=[f"{prefix}:*"], commands=["+@all"])
        tier, m, w, pool = make_tier(srv.url, prefix, username="kv", password="kvpw")
        try:
            assert store(m, w, keys_for(1, seed=3), [0])
            assert lookup(m, keys_for(1, seed=3)[0]) is LookupResult.HIT
        finally:
            tier.shutdown()
        with pytest.raises(ConfigError, match="user 'kv'"):
            make_tier(srv.url, prefix, username="kv", password="nope")


def test_store_back_pressure_drops(redis_server, prefix):
    """Stores beyond max_queue_bytes are refused at submit (the engine never stalls)."""
    tier, m, w, pool = make_tier(redis_server.url, prefix, chunk_bytes=64 << 10, max_queue_bytes=128 << 10)
    try:
        keys = keys_for(4, seed=40)
        out = m.prepare_store(keys, CTX)
        from kvoffload.abstractions import CPULoadStoreSpec

        assert not w.submit_store(1, CPULoadStoreSpec([0, 1, 2, 3]), out.store_spec)  # 256 KiB > 128 KiB
        m.complete_store(keys, CTX, success=False)
        c = m.get_stats().counters
        assert c["store_queue_full"] == 1
    finally:
        tier.shutdown()


@pytest.mark.timeout(300)
def test_error_reply_to_exists_is_a_miss_by_the_deadline(fresh_server, prefix, caplog):
    """An error reply to EXISTS (NOPERM here: an operator took EXISTS from the
    tier's user; BUSY, CLUSTERDOWN and TRYAGAIN take the same path) ends the
    lookup as a MISS, not RETRY for as long as the server errs, and logs a
    line, not one per round. Hits come back once EXISTS is allowed again."""
    srv = fresh_server.start()
    tier, m, w, pool = make_tier(srv.url, prefix, num_chunks=4, chunk_bytes=16 << 10, lookup_deadline_s=2.0,
                                 miss_cache_s=0.01)
    admin = redis.Redis(port=srv.port)
    try:
        key = keys_for(1, seed=41)[0]
        fill(pool, [0], seed=41)
        assert store(m, w, [key], [0])
        m.reset_cache()
        admin.execute_command("ACL", "SETUSER", "default", "-exists")
        with caplog.at_level(logging.WARNING, logger="kvoffload"):
            # each lookup re-asks (miss_cache_s is short), each answer is an error reply
            for _ in range(20):
                assert lookup(m, key, give_up_s=20.0) is LookupResult.MISS
                time.sleep(0.02)
        warnings = [r.getMessage() for r in caplog.records]
        assert len(warnings) == 1 and "no permissions" in warnings[0], warnings
        assert not m.has_pending_work()
        admin.execute_command("ACL", "SETUSER", "default", "+exists")
        wait_until(lambda: lookup(m, key) is LookupResult.HIT, "a HIT once EXISTS is allowed again")
    finally:
        admin.close()
        tier.shutdown()


class _Trickle:
    """A TCP proxy in front of the server. Requests pass at once; replies too,
    until `slow` is set: then 16 bytes per 50 ms (320 B/s), so no single
    receive ever waits a whole socket timeout (a congested or half-dead link)."""

    def __init__(self, server_port: int):
        import socket
        import threading

        self.slow = threading.Event()
        self._closed = threading.Event()
        self._socks: list = []
        self._listen = socket.create_server(("127.0.0.1", 0))
        self.port = self._listen.getsockname()[1]
        threading.Thread(target=self._accept, args=(server_port,), daemon=True).start()

    def _accept(self, server_port: int) -> None:
        import socket
        import threading

        while not self._closed.is_set():
            try:
                client, _ = self._listen.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", server_port))
            self._socks += [client, server]
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, src, dst, replies: bool) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                while data:
                    if replies and self.slow.is_set():
                        dst.sendall(data[:16])
                        data = data[16:]
                        time.sleep(0.05)
                    else:
                        dst.sendall(data)
                        data = b""
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass

    def close(self) -> None:
        self._closed.set()
        self._listen.close()
        for s in self._socks:
            try:
                s.close()
            except OSError:
                pass


@pytest.mark.timeout(300)
def test_a_trickling_link_fails_the_load_by_its_deadline(fresh_server, prefix):
    """A link that still delivers a few bytes at a time never lets one receive
    time out: without a deadline per round this 256 KiB load would take about
    800 s. With min_transfer_mib_s it fails as a network error (back-off,
    counted) within about socket_timeout_s of its deadline, and loads work
    again once the link is healthy."""
    srv = fresh_server.start()
    proxy = _Trickle(srv.port)
    tier, m, w, pool = make_tier(f"redis://127.0.0.1:{proxy.port}/0", prefix, num_chunks=4, chunk_bytes=256 << 10,
                                 socket_timeout_s=2.0, min_transfer_mib_s=16.0, backoff_initial_s=0.02,
                                 backoff_max_s=0.2)
    try:
        keys = keys_for(1, seed=51)
        fill(pool, [0], seed=51)
        assert store(m, w, keys, [0])
        assert lookup(m, keys[0]) is LookupResult.HIT
        proxy.slow.set()
        t0 = time.monotonic()
        assert not load(m, w, keys, [1])
        took = time.monotonic() - t0
        assert took < 60.0, took  # about 2-4 s here; the trickle itself needs about 800 s
        stats = m.get_stats()
        assert stats.counters["load_failures"] >= 1 and not undeclared(stats)
        proxy.slow.clear()
        wait_until(lambda: load(m, w, keys, [2]), "a load once the link is healthy")
        assert np.array_equal(pool.array[2], pool.array[0])
    finally:
        tier.shutdown()
        proxy.close()
