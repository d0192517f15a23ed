"""A tiered spec whose build fails after the storage tier opened releases it
(files and directory lock), so a corrected retry in the same process works;
the same directory listed twice is named as such."""

from __future__ import annotations

import os

import pytest

from kvoffload.config import ConfigError, OffloadingConfig
from kvoffload.spec import build_spec


def _spec(tiers: list[dict]):
    config = OffloadingConfig.from_dict({
        "groups": [{"tokens_per_block": 16}],
        "extra_config": {"num_cpu_chunks": 2, "kv_bytes_per_chunk": 2 * 8192,
                         "namespace": {"model": "tiny"}, "secondary_tiers": tiers},
    })
    return build_spec("tiered", config)


def _fds_under(path) -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(path)):
            out.append(target)
    return out


def _storage(path) -> dict:
    return {"type": "storage", "path": str(path), "capacity_bytes": "1MiB"}


def _retry_works(path, tiers_after) -> None:
    assert _fds_under(path) == []  # nothing of the failed build is still open
    spec = _spec(tiers_after)
    mgr = spec.get_manager()
    assert [t.name for t in mgr.tiers][0] == "storage"
    mgr.shutdown()


def test_second_tier_failing_releases_the_first(tmp_path):
    kv = tmp_path / "kv"
    with pytest.raises(ConfigError, match=r"secondary_tiers\[1\].*capacity_bytes"):
        _spec([_storage(kv), {**_storage(tmp_path / "kv2"), "capacity_bytes": "lots"}])
    _retry_works(kv, [_storage(kv), _storage(tmp_path / "kv2")])


def test_same_path_twice_is_named(tmp_path):
    kv = tmp_path / "kv"
    with pytest.raises(ConfigError, match=r"secondary_tiers\[1\]\.path: .* is listed twice in secondary_tiers "
                                          r"\(also secondary_tiers\[0\]\)") as e:
        _spec([_storage(kv), {**_storage(str(kv) + "/."), "name": "again"}])
    assert "in use" not in str(e.value)
    _retry_works(kv, [_storage(kv)])


@pytest.mark.redis
def test_redis_tier_with_a_bad_password_releases_storage(tmp_path):
    from kvoffload.tiers.redis.server import LocalServer, find_server_binary

    if find_server_binary() is None:
        if os.environ.get("CI"):
            pytest.fail("no redis-server binary")
        pytest.skip("no redis-server binary")
    srv = LocalServer(password="right-password", maxmemory="16mb").start()
    kv = tmp_path / "kv"
    try:
        bad = {"type": "redis", "url": f"redis://:wrong@127.0.0.1:{srv.port}/0"}
        with pytest.raises(ConfigError, match="authentication|credentials"):
            _spec([_storage(kv), bad])
        good = {"type": "redis", "url": srv.url}
        _retry_works(kv, [_storage(kv), good])
    finally:
        srv.close()


def test_bad_eviction_policy_then_a_fixed_retry(tmp_path):
    kv = tmp_path / "kv"
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\].*eviction_policy.*lru_typo"):
        _spec([{**_storage(kv), "eviction_policy": "lru_typo"}])
    _retry_works(kv, [{**_storage(kv), "eviction_policy": "lru"}])


def test_nul_byte_in_path_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\]\.path: contains a NUL byte") as e:
        _spec([_storage(f"{tmp_path}/a\0b")])
    assert "\n" not in str(e.value)
