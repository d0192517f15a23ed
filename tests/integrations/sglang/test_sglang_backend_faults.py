"""The SGLang backend under faults: a corrupt value or slab is a miss, never
served; an unreachable server or a paused store node is misses, not a hang;
an error midway still ends every load; close() during a stuck load does not
crash."""

from __future__ import annotations

import glob
import os

import pytest

from sglang_pool import need_sglang

need_sglang()
from sglang_backend_rig import (  # noqa: E402
    PAGE,
    PATIENT,
    keys,
    make_backend,
    page_bytes,
    pages,
    settled,
    storage_section,
    tier_section,
)

from kvoffload.integrations.sglang.pages import key_bytes  # noqa: E402


def test_corrupt_value_is_a_miss_redis(request, tmp_path, prefix):
    section = tier_section("redis", request, tmp_path, prefix)
    backend, pool = make_backend(section)
    try:
        pool.fill_random(5)
        ks = keys(3, "corrupt")
        assert backend.batch_set_v1(ks, pages(0, 1, 2)) == [True] * 3
        want = [page_bytes(pool, p) for p in range(3)]
        import redis

        r = redis.Redis.from_url(section["url"])
        rkey = backend.io.tier.keyspace.redis_key(key_bytes(ks[1]))
        v = bytearray(r.get(rkey))
        v[-100] ^= 0x01
        r.set(rkey, bytes(v))
        pool.kv_buffer.zero_()
        assert backend.batch_get_v1(ks, pages(3, 4, 5)) == [True, False, True]
        assert (page_bytes(pool, 3), page_bytes(pool, 5)) == (want[0], want[2])
        assert not pool.get_data_page(4 * PAGE).any()  # the corrupt bytes never reached the host pool
    finally:
        backend.close()


def test_corrupt_value_is_a_miss_mooncake(request, tmp_path, prefix):
    from mooncake.store import MooncakeDistributedStore

    srv = request.getfixturevalue("mooncake")
    backend, pool = make_backend(tier_section("mooncake", request, tmp_path, prefix))
    raw = MooncakeDistributedStore()
    assert raw.setup("127.0.0.1", srv.metadata_server, 0, 16 << 20, "tcp", "", srv.master_address) == 0
    try:
        pool.fill_random(6)
        ks = keys(2, "mc-corrupt")
        assert backend.batch_set_v1(ks, pages(0, 1)) == [True, True]
        rkey = backend.io.tier.keyspace.redis_key(key_bytes(ks[0]))
        v = bytearray(raw.get(rkey))
        v[-1] ^= 0x80
        assert raw.remove(rkey, True) == 0 and raw.put(rkey, bytes(v)) == 0
        pool.kv_buffer.zero_()
        assert backend.batch_get_v1(ks, pages(2, 3)) == [False, True]
        assert not pool.get_data_page(2 * PAGE).any()
    finally:
        raw.close()
        backend.close()


def test_corrupt_slab_is_a_miss_storage(tmp_path):
    section = {"type": "storage", "path": str(tmp_path / "l3"), "capacity_bytes": "1MiB", "direct_io": False,
               "num_files": 1}
    backend, pool = make_backend(section)
    try:
        pool.fill_random(7)
        ks = keys(3, "slab")
        assert backend.batch_set_v1(ks, pages(0, 1, 2)) == [True] * 3
        want = [page_bytes(pool, p) for p in range(3)]
        (slab,) = glob.glob(str(tmp_path / "l3" / "ns-*" / "slab-*.bin"))
        slot = backend.format.page_bytes  # 4 KiB pages: slot 1 starts at 4096 in the only slab file
        with open(slab, "r+b") as f:
            f.seek(slot + 10)
            b = f.read(1)
            f.seek(slot + 10)
            f.write(bytes([b[0] ^ 0xFF]))
            os.fsync(f.fileno())
        pool.kv_buffer.zero_()
        got = backend.batch_get_v1(ks, pages(3, 4, 5))
        assert got.count(False) == 1  # exactly the page in slot 1, whichever key it was
        for ok, dst, w in zip(got, (3, 4, 5), want):
            assert page_bytes(pool, dst) == (w if ok else bytes(len(w)))
    finally:
        backend.close()


def test_unreachable_server_is_misses_not_a_hang(tmp_path):
    from kvoffload.tiers.remote.process import free_port

    section = {"type": "redis", "url": f"redis://127.0.0.1:{free_port()}/0", "connect_timeout_s": 0.2,
               "socket_timeout_s": 0.2, "lookup_deadline_s": 0.3}
    backend, pool = make_backend(section)
    try:
        ks = keys(2, "down")
        assert backend.batch_set_v1(ks, pages(0, 1)) == [False, False]
        assert backend.batch_exists(ks) == 0
        assert backend.batch_get_v1(ks, pages(2, 3)) == [False, False]
    finally:
        backend.close()


def test_an_error_after_loads_started_still_ends_every_load(tmp_path, monkeypatch):
    backend, pool = make_backend(storage_section(tmp_path))  # 8 KiB jobs: a job per page
    try:
        pool.fill_random(4)
        ks = keys(4, "midway")
        assert backend.batch_set_v1(ks, pages(0, 1, 2, 3)) == [True] * 4

        def copy_fails(*a, **k):
            raise RuntimeError("copy failed")

        monkeypatch.setattr(backend._copier, "from_slots", copy_fails)
        with pytest.raises(RuntimeError, match="copy failed"):
            backend.batch_get_v1(ks, pages(4, 5, 6, 7))  # fails on the first page, 3 loads still started
        assert settled(backend)  # they used to stay pinned, their results uncollected
        monkeypatch.undo()
        assert backend.batch_get_v1(ks, pages(4, 5, 6, 7)) == [True] * 4
    finally:
        backend.close()


def test_close_during_a_load_stuck_on_a_paused_store_node_does_not_crash(prefix):
    """SGLang's close() while its prefetch thread is stuck in the client: the client was closed under
    the call (SIGSEGV). In a process of its own (tests/tiers/mooncake/mooncake_stuck_proc.py)."""
    import sys
    from pathlib import Path

    from kvoffload.tiers.mooncake.server import LocalMooncake, find_binary

    if find_binary("mooncake_master") is None:
        pytest.skip("no mooncake_master binary")
    sys.path.insert(0, str(Path(__file__).parents[2] / "tiers" / "mooncake"))
    from mooncake_stuck_proc import run_stuck_shutdown

    with LocalMooncake(store_bytes=64 << 20) as srv:
        rc, out = run_stuck_shutdown(srv, prefix, "sglang")
    assert rc == 0 and "survived\nload returned" in out, out
    assert "the client is left open" in out


def test_a_paused_store_node_is_misses_within_the_transfer_timeout(prefix):
    import time

    from kvoffload.tiers.mooncake.server import LocalMooncake, find_binary
    from kvoffload.tiers.remote.process import pause, resume

    if find_binary("mooncake_master") is None:
        pytest.skip("no mooncake_master binary")
    with LocalMooncake(store_bytes=64 << 20) as srv:
        section = {"type": "mooncake", **srv.tier_config(key_prefix=prefix, segment_bytes=0, transfer_timeout_s=1.0,
                                                          **PATIENT)}
        backend, pool = make_backend(section, job="64KiB")
        try:
            pool.fill_random(5)
            ks = keys(8, "paused-node")
            assert backend.batch_set_v1(ks, pages(*range(8))) == [True] * 8
            pause(srv.node)
            try:
                t0 = time.monotonic()
                assert backend.batch_get_v1(ks, pages(*range(8, 16))) == [False] * 8
                assert time.monotonic() - t0 < 30  # generous: was 60 s, Mooncake's own transfer timeout
            finally:
                resume(srv.node)
        finally:
            backend.close()
