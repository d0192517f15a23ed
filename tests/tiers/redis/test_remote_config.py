"""Config: every bad value is a ConfigError naming the key; passwords never leak."""

from __future__ import annotations

import pytest

from kvoffload.config import ConfigError
from kvoffload.tiers.remote.config import RemoteConfig
from kvoffload.tiers.remote.network import Backoff


@pytest.mark.parametrize("bad, key", [
    ({"urll": "redis://x"}, "urll"),
    ({"url": "http://x"}, "remote.url"),
    ({"url": 5}, "remote.url"),
    ({"socket_timeout_s": 0}, "remote.socket_timeout_s"),
    ({"connect_timeout_s": "1"}, "remote.connect_timeout_s"),
    ({"io_threads": 0}, "remote.io_threads"),
    ({"io_threads": 10_000}, "remote.io_threads must be at most 256"),  # was started: 10,000 threads
    ({"ttl_s": -1}, "remote.ttl_s"),
    ({"cluster": "yes"}, "remote.cluster"),
    ({"key_prefix": "a b"}, "remote.key_prefix"),
    ({"batch_bytes": "lots"}, "remote.batch_bytes"),
    ({"backoff_initial_s": 2.0, "backoff_max_s": 1.0}, "remote.backoff_max_s"),
    ({"cluster": True, "url": "unix:///tmp/x.sock"}, "remote.cluster"),
    ({"lookup_deadline_s": 0}, "remote.lookup_deadline_s"),
    ({"lookup_deadline_s": 0.001, "lookup_coalesce_s": 0.002}, "remote.lookup_deadline_s"),
    ({"mac_key_file": 5}, "remote.mac_key_file"),
    ({"mac_key_file": "/k", "mac_key_env": "K"}, "remote.mac_key_file"),
    # a URL urlsplit / redis-py cannot read: named here, not a ValueError at start-up
    ({"url": "redis://127.0.0.1:99999/0"}, "remote.url"),
    ({"url": "redis://127.0.0.1:abc/0"}, "remote.url"),
    ({"url": "redis://127.0.0.1:0/0"}, "remote.url"),
    ({"url": "redis://[::1/0"}, "remote.url"),
    # below a microsecond the kernel's timeout is 0 (none: a hung server blocks forever);
    # infinite ones overflow at connect
    ({"socket_timeout_s": 1e-7}, "remote.socket_timeout_s"),
    ({"connect_timeout_s": float("inf")}, "remote.connect_timeout_s"),
    ({"socket_timeout_s": 1e300}, "remote.socket_timeout_s"),
    ({"lookup_cache_s": float("inf")}, "remote.lookup_cache_s"),
    ({"min_transfer_mib_s": -1}, "remote.min_transfer_mib_s"),
    ({"min_transfer_mib_s": float("nan")}, "remote.min_transfer_mib_s"),
    ({"min_transfer_mib_s": float("inf")}, "remote.min_transfer_mib_s"),
    ({"min_transfer_mib_s": "fast"}, "remote.min_transfer_mib_s"),
    ({"min_transfer_mib_s": True}, "remote.min_transfer_mib_s"),
    ({"ttl_s": 10**16}, "remote.ttl_s"),  # Redis would refuse every SET
])
def test_bad_values_name_the_key(bad, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        RemoteConfig.from_dict(bad)


def test_sizes_and_defaults():
    cfg = RemoteConfig.from_dict({"batch_bytes": "8MiB", "max_queue_bytes": "2GiB"})
    assert cfg.batch_bytes == 8 << 20 and cfg.max_queue_bytes == 2 << 30
    assert RemoteConfig.from_dict(None).url.startswith("redis://")
    for url in ("rediss://h:6380/0", "unix:///run/redis.sock", "valkey://h/0"):
        assert RemoteConfig(url=url).url == url


def test_redacted_url():
    assert RemoteConfig(url="redis://u:secret@host:6379/0").redacted_url == "redis://u:***@host:6379/0"
    assert RemoteConfig(url="redis://host:6379/0").redacted_url == "redis://host:6379/0"


def test_tls_url_builds_an_ssl_client():
    from redis.connection import SSLConnection

    from kvoffload.tiers.redis.connection import build_client

    client = build_client(RemoteConfig(url="rediss://127.0.0.1:1/0", tls_verify=False))
    assert client.connection_pool.connection_class is SSLConnection


def test_backoff_doubles_to_cap_and_resets():
    b = Backoff(0.01, 0.04)
    assert b.available() and not b.is_down
    delays = []
    for _ in range(4):
        b.failed()
        delays.append(b._delay)
    assert delays == [0.01, 0.02, 0.04, 0.04] and not b.available() and b.is_down
    b.succeeded()
    assert b.available() and b.reconnects == 1 and not b.is_down


def test_a_url_redis_py_cannot_read_is_a_config_error():
    from kvoffload.tiers.redis.connection import build_client

    with pytest.raises(ConfigError, match=r"remote\.url 'redis://:\*\*\*@127\.0\.0\.1:1/0\?db=x': .*'db'"):
        build_client(RemoteConfig(url="redis://:pw@127.0.0.1:1/0?db=x"))
