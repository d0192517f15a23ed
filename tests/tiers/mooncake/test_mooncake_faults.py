"""Outages and bad settings: a paused master delays a lookup by
lookup_deadline_s only; a bad address or value at start-up is one clear
line (ConfigError), never a traceback or a minutes-long retry loop."""

from __future__ import annotations

import json
import time

import pytest

from kvoffload.abstractions import LookupResult
from kvoffload.cli import main
from kvoffload.config import ConfigError
from kvoffload.tiers.base import Namespace
from kvoffload.tiers.mooncake import MooncakeConfig, MooncakeTier
from kvoffload.tiers.remote.process import free_port, pause, resume
from mooncake_helpers import CTX, fill, keys_for, load, lookup, make_tier, store, wait_until
from mooncake_stuck_proc import run_stuck_shutdown

pytestmark = pytest.mark.mooncake


@pytest.mark.timeout(600)
def test_paused_master_delays_a_lookup_by_the_deadline_only(fresh_mooncake, prefix):
    srv = fresh_mooncake.start()
    tier, m, w, pool = make_tier(srv, prefix, num_chunks=8, chunk_bytes=16 << 10, rpc_timeout_s=60.0,
                                 lookup_deadline_s=0.2, lookup_cache_s=30.0, miss_cache_s=0.05)
    try:
        keys = keys_for(3, seed=33)
        fill(pool, range(3), seed=33)
        assert store(m, w, keys, [0, 1, 2])
        m.reset_cache()
        srv.pause_master()
        try:
            # lookup() gives up (fails the test) after 45 s, below the 60 s RPC timeout
            assert lookup(m, keys[0]) is LookupResult.MISS
            assert lookup(m, keys[1]) is LookupResult.MISS  # a new key does not queue behind the stuck check
            assert srv.master.poll() is None  # still there, still stopped: the answers came without it
            assert m.get_stats().counters["lookup_timeouts"] >= 2
        finally:
            srv.resume_master()
        wait_until(lambda: lookup(m, keys[2]) is LookupResult.HIT, "a HIT after the master resumed")
        assert lookup(m, keys[0]) is LookupResult.HIT
    finally:
        tier.shutdown()


def _ns():
    return Namespace(model="tiny", chunk_bytes=4096)


def test_dead_master_at_start_is_one_clear_line(mooncake):
    port = free_port()
    with pytest.raises(ConfigError) as e:
        MooncakeTier({"master_address": f"127.0.0.1:{port}", "metadata_server": mooncake.metadata_server}, _ns())
    msg = str(e.value)
    assert f"master 127.0.0.1:{port} unreachable" in msg and "mooncake.master_address" in msg and "\n" not in msg


def test_dead_metadata_server_at_start_is_one_clear_line(mooncake):
    url = f"http://127.0.0.1:{free_port()}/metadata"
    with pytest.raises(ConfigError, match=f"metadata server {url} unreachable") as e:
        MooncakeTier({"master_address": mooncake.master_address, "metadata_server": url}, _ns())
    assert "\n" not in str(e.value)


def test_dead_etcd_metadata_server_at_start_is_one_quick_line(mooncake):
    url = f"etcd://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=f"metadata server {url} unreachable") as e:
        MooncakeTier({"master_address": mooncake.master_address, "metadata_server": url}, _ns())
    assert "\n" not in str(e.value)
    assert time.monotonic() - t0 < 20  # generous: the client's own retries took 30 s


@pytest.mark.parametrize("conf, match", [
    ({"master_address": "127.0.0.1"}, "mooncake.master_address must be 'host:port'"),
    ({"master_address": "127.0.0.1:0"}, "port in 1..65535"),
    ({"metadata_server": "ftp://x"}, "mooncake.metadata_server"),
    ({"protocol": "udp"}, "mooncake.protocol"),
    ({"segment_bytes": -1}, "mooncake.segment_bytes"),
    ({"segment_bytes": "lots"}, "mooncake.segment_bytes"),
    ({"replicas": 0}, "mooncake.replicas"),
    ({"lookup_deadline_s": 0.001}, "mooncake.lookup_deadline_s"),
    ({"url": "redis://127.0.0.1:6379"}, "must be mooncake://HOST:PORT"),
    ({"url": "mooncake://127.0.0.1:50051?metadata=http://x"}, "unknown key 'metadata'.*metadata_server"),
    ({"url": "mooncake://127.0.0.1"}, "HOST:PORT"),
    ({"mac_key_env": "KVO_UNSET_MAC_VAR"}, "mooncake.mac_key_env 'KVO_UNSET_MAC_VAR'"),
    ({"masteraddress": "x"}, "unknown key 'masteraddress'.*master_address"),
    ({"url": 5}, "mooncake.url must be a string"),
    ({"url": ["x"]}, "mooncake.url must be a string"),
    ({"url": "mooncake://[::1"}, r"mooncake\.url 'mooncake://\[::1': Invalid IPv6 URL"),
    ({"metadata_server": "http://127.0.0.1:99999/metadata"}, r"mooncake\.metadata_server .*Port out of range"),
    ({"rpc_timeout_s": float("inf")}, r"mooncake\.rpc_timeout_s must be at most"),
    ({"connect_timeout_s": 1e-7}, r"mooncake\.connect_timeout_s must be at least"),
    # the client has no redis metadata plugin: it aborted the process (SIGABRT) in set-up
    ({"metadata_server": "redis://127.0.0.1:6379"}, r"mooncake\.metadata_server must be an http://, https://"),
    ({"replicas": 2**64}, r"mooncake\.replicas must be at most 64"),  # was a TypeError from the client
    ({"replicas": 2**40}, r"mooncake\.replicas must be at most 64"),  # was accepted; every store then failed
    ({"io_threads": 10_000}, r"mooncake\.io_threads must be at most 256"),  # was started: 10,000 threads
    ({"transfer_timeout_s": 0.5}, r"mooncake\.transfer_timeout_s must be at least 1"),
    ({"backoff_max_s": float("inf")}, r"mooncake\.backoff_max_s must be at most"),
])
def test_bad_config_names_the_key(conf, match, monkeypatch):
    monkeypatch.delenv("KVO_UNSET_MAC_VAR", raising=False)
    with pytest.raises(ConfigError, match=match):
        MooncakeTier(conf, _ns())


def test_url_gives_master_and_default_metadata():
    cfg = MooncakeConfig.from_dict({"url": "mooncake://10.0.0.5:50051", "key_prefix": "k"})
    assert (cfg.master_address, cfg.metadata_server) == ("10.0.0.5:50051", "http://10.0.0.5:8080/metadata")
    cfg = MooncakeConfig.from_dict({"url": "mooncake://h:1?metadata_server=P2PHANDSHAKE&segment_bytes=1GiB"})
    assert cfg.metadata_server == "P2PHANDSHAKE" and cfg.segment_bytes == 1 << 30


def test_replay_cli_remote_url(mooncake, prefix, tmp_path, capsys):
    js = tmp_path / "r.json"
    url = f"{mooncake.url}&key_prefix={prefix}&segment_bytes=0"
    rc = main(["replay", "--sessions", "4", "--no-progress", "--remote-url", url, "--json", str(js)])
    assert rc == 0, capsys.readouterr().err
    report = json.loads(js.read_text())
    assert report["result"]["tiers"]["mooncake"]["counters"]["stored_blocks"] > 0
    assert report["result"]["counters"]["verify_failures"] == 0


def test_replay_cli_dead_master_is_one_line(capsys):
    rc = main(["replay", "--sessions", "2", "--no-progress", "--remote-url", f"mooncake://127.0.0.1:{free_port()}"])
    err = capsys.readouterr().err
    assert rc == 2 and "unreachable" in err and "Traceback" not in err


class _MalformedOnce:
    """The real client, except that the first batch_is_exist answers None: a
    fault a real master does not produce on demand, standing for any
    exception a lookup round may meet."""

    def __init__(self, client):
        self._client, self.calls = client, 0

    def batch_is_exist(self, keys):
        self.calls += 1
        return None if self.calls == 1 else self._client.batch_is_exist(keys)

    def __getattr__(self, name):
        return getattr(self._client, name)


def test_lookup_thread_survives_a_failed_round(mooncake, prefix):
    tier, m, w, pool = make_tier(mooncake, prefix, num_chunks=4, chunk_bytes=16 << 10, lookup_deadline_s=2.0,
                                 miss_cache_s=0.01)
    try:
        keys = keys_for(2, seed=34)
        fill(pool, range(2), seed=34)
        assert store(m, w, keys, [0, 1])
        m.reset_cache()
        m._checker._client = faulty = _MalformedOnce(m._checker._client)
        assert lookup(m, keys[0]) is LookupResult.MISS  # the failed round: unknown, a short-lived miss
        assert faulty.calls == 1
        wait_until(lambda: [lookup(m, k) for k in keys] == [LookupResult.HIT] * 2, "HITs after the failed round")
    finally:
        tier.shutdown()


def test_shutdown_during_a_stuck_transfer_leaves_the_client_open(fresh_mooncake, prefix):
    rc, out = run_stuck_shutdown(fresh_mooncake.start(), prefix, "tier")
    # was SIGSEGV (-11) once the stuck call returned into the client closed under it
    assert rc == 0 and "survived\nload returned" in out, out
    assert "the client is left open" in out


@pytest.mark.parametrize("fault", ["pause", "kill"])
def test_a_store_node_not_answering_fails_a_load_by_transfer_timeout_and_backs_off(fresh_mooncake, prefix, fault):
    srv = fresh_mooncake.start()
    tier, m, w, pool = make_tier(srv, prefix, num_chunks=8, chunk_bytes=16 << 10)  # transfer_timeout_s 2
    try:
        keys = keys_for(4, seed=36)
        fill(pool, range(4), seed=36)
        assert store(m, w, keys, [0, 1, 2, 3])
        if fault == "pause":
            pause(srv.node)
        else:
            srv.node.kill()
            srv.node.wait()
        t0 = time.monotonic()
        # a killed node's open connection fails the first load at once (no back-off: like a value of
        # another size); the next one waits out the client's 1 s of reconnecting
        for _ in range(1 if fault == "pause" else 2):
            assert not load(m, w, keys, [4, 5, 6, 7])
        assert time.monotonic() - t0 < 30  # generous: Mooncake's own transfer timeout is 60 s
        assert m.get_stats().gauges["server_up"] == 0.0  # a node not answering backs off like the master
    finally:
        resume(srv.node)
        tier.shutdown()


def test_a_key_not_bytes_does_not_fail_the_keys_checked_with_it(mooncake, prefix):
    tier, m, w, pool = make_tier(mooncake, prefix, num_chunks=4, chunk_bytes=16 << 10)
    try:
        keys = keys_for(1, seed=37)
        fill(pool, [0], seed=37)
        assert store(m, w, keys, [0])
        m.reset_cache()
        assert m.lookup("not bytes", CTX) is LookupResult.RETRY  # queued for the same round as the next
        assert lookup(m, keys[0]) is LookupResult.HIT  # was MISS: the whole round failed on the str key
        assert lookup(m, "not bytes") is LookupResult.MISS
    finally:
        tier.shutdown()


def test_a_lookup_the_master_answers_does_not_end_the_back_off_of_a_node_that_is_down(fresh_mooncake, prefix):
    """The master answers lookups while the store node holding the values is
    stopped. That success must not end the transfers' back-off: with one
    back-off for both, each answered lookup reset it, the tier reported the
    server up, and every load that followed paid a whole transfer timeout."""
    srv = fresh_mooncake.start()
    tier, m, w, pool = make_tier(srv, prefix, num_chunks=8, chunk_bytes=16 << 10, backoff_initial_s=0.05,
                                 backoff_max_s=0.2, lookup_cache_s=0.01, miss_cache_s=0.01)
    try:
        keys = keys_for(2, seed=37)
        fill(pool, range(2), seed=37)
        assert store(m, w, keys, [0, 1])
        pause(srv.node)
        try:
            assert not load(m, w, keys, [2, 3])  # the node does not answer: the transfer times out
            assert m.get_stats().gauges["server_up"] == 0.0
            # once the back-off has passed, the master answers: the blocks are there
            wait_until(lambda: lookup(m, keys[0]) is LookupResult.HIT, "the master's answer")
            stats = m.get_stats()
            assert stats.gauges["server_up"] == 0.0  # was 1.0: the lookup had ended the one back-off
            assert tier.state.transfer_backoff.failures >= 1 and tier.state.backoff.failures == 0
        finally:
            resume(srv.node)
        wait_until(lambda: load(m, w, keys, [2, 3]), "a load once the node runs again")
        assert m.get_stats().gauges["server_up"] == 1.0
    finally:
        tier.shutdown()
