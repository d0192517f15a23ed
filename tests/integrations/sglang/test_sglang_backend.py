"""kvoffload's tiers as an SGLang HiCache storage backend, built by SGLang's
own StorageBackendFactory ("dynamic" backend) with its real
HiCacheStorageConfig, on real files, a real redis-server and a real Mooncake
Store. Pages are SGLang host-pool pages (sglang_pool.py)."""

from __future__ import annotations

import glob
import os

import pytest
import torch

from sglang_pool import SGLangMHAHostPool, need_sglang

need_sglang()
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from kvoffload.config import ConfigError  # noqa: E402
from kvoffload.integrations.sglang.backend import KvoffloadHiCacheStorage  # noqa: E402
from kvoffload.integrations.sglang.pages import key_bytes  # noqa: E402

PAGE = 16
PATIENT = dict(lookup_deadline_s=30.0, connect_timeout_s=10.0)  # a loaded machine must not turn a HIT into a MISS


def storage_config(extra: dict, tp_rank=0, tp_size=1, model="tiny-llama") -> HiCacheStorageConfig:
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=False, enable_storage_metrics=False,
                                is_page_first_layout=True, model_name=model, extra_config=extra)


def tier_section(kind: str, request, tmp_path, prefix: str) -> dict:
    if kind == "storage":
        return {"type": "storage", "path": str(tmp_path / "l3"), "capacity_bytes": "4MiB", "direct_io": False}
    if kind == "redis":
        srv = request.getfixturevalue("redis_server")
        return {"type": "redis", "url": srv.url, "key_prefix": prefix, **PATIENT}
    srv = request.getfixturevalue("mooncake")
    return {"type": "mooncake", **srv.tier_config(key_prefix=prefix, segment_bytes=0, rpc_timeout_s=30.0, **PATIENT)}


def make_backend(section: dict, layout="page_first", staging="1MiB", job="8KiB", **cfg) -> tuple[HiCacheStorage, SGLangMHAHostPool]:
    """What SGLang's HiCacheController does: factory, then register the host pool."""
    extra = {"backend_name": "kvoffload", "module_path": "kvoffload.integrations.sglang",
             "class_name": "KvoffloadHiCacheStorage", "interface_v1": 1,
             "kvoffload": {"staging_bytes": staging, "job_bytes": job, **section}}
    pool = SGLangMHAHostPool(size=16 * PAGE, page_size=PAGE, layer_num=2, head_num=2, head_dim=32, layout=layout)
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(extra, **cfg), pool)
    backend.register_mem_pool_host(pool)
    return backend, pool


def keys(n: int, salt: str = "") -> list[str]:
    import hashlib

    return [hashlib.sha256(f"{salt}page{i}".encode()).hexdigest() for i in range(n)]


def pages(*ids: int) -> torch.Tensor:
    """host indices of whole pages"""
    return torch.cat([torch.arange(i * PAGE, (i + 1) * PAGE) for i in ids])


def page_bytes(pool, page_id: int) -> bytes:
    return pool.get_data_page(page_id * PAGE, flat=True).contiguous().view(torch.uint8).numpy().tobytes()


@pytest.fixture(params=["storage", "redis", "mooncake"])
def section(request, tmp_path, prefix):
    return tier_section(request.param, request, tmp_path, prefix)


def test_factory_builds_our_class_from_extra_config(section):
    backend, _ = make_backend(section)
    try:
        assert isinstance(backend, KvoffloadHiCacheStorage) and isinstance(backend, HiCacheStorage)
        assert backend.namespace.layout.startswith("sglang-")
    finally:
        backend.close()


def test_round_trip_byte_for_byte_zero_copy(section):
    # 4 KiB pages, 8 staging slots a direction, jobs of 2 pages: 6 pages are 3 jobs, 30 are 4 rounds
    backend, pool = make_backend(section, staging="64KiB")
    try:
        pool.fill_random(1)
        ks = keys(6)
        want = [page_bytes(pool, p) for p in range(6)]
        assert backend.batch_exists(ks) == 0
        assert backend.batch_set_v1(ks, pages(*range(6))) == [True] * 6
        assert backend.batch_exists(ks) == 6
        assert backend.batch_exists(ks[:3] + keys(1, "absent") + ks[3:]) == 3
        assert backend.exists(ks[5]) and not backend.exists(keys(1, "absent")[0])
        pool.kv_buffer.zero_()
        # into other pages, out of order
        assert backend.batch_get_v1(ks, pages(10, 9, 8, 7, 6, 11)) == [True] * 6
        assert [page_bytes(pool, p) for p in (10, 9, 8, 7, 6, 11)] == want
    finally:
        backend.close()


def test_generic_calls_store_the_same_bytes(section):
    """Without interface_v1 SGLang hands flat data pages: same value bytes as the zero-copy calls."""
    backend, pool = make_backend(section)
    try:
        pool.fill_random(2)
        ks = keys(3, "generic")
        assert backend.batch_set_v1(ks[:2], pages(0, 1)) == [True, True]
        assert backend.batch_set([ks[2]], [pool.get_data_page(2 * PAGE, flat=True)])
        got = backend.batch_get(ks, [pool.get_dummy_flat_data_page() for _ in ks])
        assert [g.view(torch.uint8).numpy().tobytes() for g in got] == [page_bytes(pool, p) for p in range(3)]
        pool.kv_buffer.zero_()
        assert backend.batch_get_v1(ks[2:], pages(5)) == [True]
        assert page_bytes(pool, 5) == got[2].view(torch.uint8).numpy().tobytes()
        assert backend.get(keys(1, "absent")[0], pool.get_dummy_flat_data_page()) is None
    finally:
        backend.close()


def test_a_missing_page_fails_only_itself(section):
    backend, pool = make_backend(section)
    try:
        pool.fill_random(3)
        ks = keys(3, "partial")
        assert backend.batch_set_v1([ks[0], ks[2]], pages(0, 2)) == [True, True]
        want0, want2 = page_bytes(pool, 0), page_bytes(pool, 2)
        pool.kv_buffer.zero_()
        assert backend.batch_get_v1(ks, pages(4, 5, 6)) == [True, False, True]
        assert (page_bytes(pool, 4), page_bytes(pool, 6)) == (want0, want2)
        assert not pool.get_data_page(5 * PAGE).any()
    finally:
        backend.close()


@pytest.mark.parametrize("kind", ["redis", "mooncake"])
def test_layout_and_shard_keep_engines_apart_same_ones_share(request, tmp_path, prefix, kind):
    """Two SGLang engines on one server: pages are shared only when model, host layout and TP shard agree."""
    section = tier_section(kind, request, tmp_path, prefix)
    a, pool = make_backend(section)
    same, _ = make_backend(section)
    other_layout, _ = make_backend(section, layout="page_first_direct")
    other_rank, _ = make_backend(section, tp_rank=1, tp_size=2)
    other_model, _ = make_backend(section, model="other-model")
    try:
        pool.fill_random(4)
        ks = keys(4, "share")
        assert a.batch_set_v1(ks, pages(0, 1, 2, 3)) == [True] * 4
        assert same.batch_exists(ks) == 4
        assert same.batch_get_v1(ks, pages(4, 5, 6, 7)) == [True] * 4
        assert [page_bytes(same.mem_pool_host, p) for p in (4, 5, 6, 7)] == [page_bytes(pool, p) for p in range(4)]
        for b in (other_layout, other_rank, other_model):
            assert b.batch_exists(ks) == 0
            assert b.batch_get_v1(ks[:1], pages(8)) == [False]
        assert len({b.namespace.digest() for b in (a, other_layout, other_rank, other_model)}) == 4
    finally:
        for b in (a, same, other_layout, other_rank, other_model):
            b.close()


def test_vllm_blocks_never_served_to_sglang(request, tmp_path, prefix):
    """A vLLM engine's chunk under the very same key bytes and size, on the same server, is not an SGLang page."""
    from kvoffload.tiers.base import Namespace
    from kvoffload.tiers.host_pool import HostPool
    from kvoffload.tiers.remote import RemoteTier

    section = tier_section("redis", request, tmp_path, prefix)
    sgl, _ = make_backend(section)
    vpool = HostPool(2, sgl.format.page_bytes)
    vllm_ns = Namespace(model="tiny-llama", dtype="torch.bfloat16", layout="canon-0123456789ab", block_size=PAGE,
                        parallel_layout="agnostic", chunk_bytes=sgl.format.page_bytes)
    vtier = RemoteTier({"url": section["url"], "key_prefix": prefix}, vllm_ns)
    try:
        k = keys(1, "vllm")[0]
        vtier.client.set(vtier.keyspace.redis_key(key_bytes(k)), b"x" * 64)  # something is there under that key
        assert vtier.client.exists(vtier.keyspace.redis_key(key_bytes(k)))
        assert sgl.batch_exists([k]) == 0
        assert sgl.batch_get_v1([k], pages(0)) == [False]
    finally:
        vtier.shutdown()
        vpool.close()
        sgl.close()


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
    from kvoffload.tiers.remote.server import free_port

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


@pytest.mark.parametrize("section, match", [
    ({"type": "nfs"}, "kvoffload.type must be one of"),
    ({"type": ["redis"]}, "kvoffload.type must be one of"),  # was TypeError: unhashable type: 'list'
    ({"type": "redis", "urll": "redis://x"}, "urll"),
    ({"type": "storage", "path": "/tmp/x", "capacity_bytes": "lots"}, "capacity_bytes"),
    ({"type": "redis", "staging_bytes": "-1"}, "staging_bytes"),
    ({"type": "redis", "job_bytes": 0}, "job_bytes"),
    ({"type": "redis", "model": ""}, "model"),
])
def test_bad_config_is_one_clear_line(section, match, tmp_path):
    with pytest.raises((ConfigError, ValueError), match=match) as e:
        make_backend(section)
    assert "\n" not in str(e.value)


def test_layer_first_is_refused_clearly(tmp_path):
    with pytest.raises(ConfigError, match="layer_first.*page_first"):
        make_backend({"type": "storage", "path": str(tmp_path), "capacity_bytes": "1MiB"}, layout="layer_first")


def make_mla_backend(section: dict, layout="page_first", tp_rank=0, tp_size=1):
    from sglang_pool import SGLangMLAHostPool

    extra = {"backend_name": "kvoffload", "module_path": "kvoffload.integrations.sglang.backend",
             "class_name": "KvoffloadHiCacheStorage", "interface_v1": 1, "kvoffload": section}
    cfg = HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                               attn_cp_size=1, is_mla_model=True, enable_storage_metrics=False,
                               is_page_first_layout=True, model_name="tiny-mla", extra_config=extra)
    pool = SGLangMLAHostPool(size=8 * PAGE, page_size=PAGE, layer_num=3, layout=layout)
    backend = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    backend.register_mem_pool_host(pool)
    return backend, pool


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_mla_pages_written_once_shared_by_every_rank(request, tmp_path, prefix, layout):
    """MLA latents are the same on every TP rank: only SGLang's storage writer (rank 0) stores, rank 1 loads them."""
    section = tier_section("redis", request, tmp_path, prefix)
    writer, wpool = make_mla_backend(section, layout, tp_rank=0, tp_size=2)
    reader, rpool = make_mla_backend(section, layout, tp_rank=1, tp_size=2)
    try:
        assert writer.namespace == reader.namespace
        ks = keys(3, f"mla-{layout}")
        rpool.fill_random(8)
        assert reader.batch_set_v1(ks, pages(0, 1, 2)) == [True] * 3  # not the writer: stores nothing
        assert writer.batch_exists(ks) == 0
        wpool.fill_random(9)
        assert writer.batch_set_v1(ks, pages(0, 1, 2)) == [True] * 3
        assert reader.batch_exists(ks) == 3
        assert reader.batch_get_v1(ks, pages(5, 6, 7)) == [True] * 3
        assert [page_bytes(rpool, p) for p in (5, 6, 7)] == [page_bytes(wpool, p) for p in range(3)]
        got = reader.batch_get(ks[:1], [rpool.get_dummy_flat_data_page()])[0]
        assert got.view(torch.uint8).numpy().tobytes() == page_bytes(wpool, 0)
    finally:
        writer.close()
        reader.close()


def test_mla_layout_sglang_has_no_ranges_for_is_refused_clearly(request, tmp_path, prefix):
    with pytest.raises(ConfigError, match="layer_first"):
        make_mla_backend(tier_section("redis", request, tmp_path, prefix), "layer_first")


def test_exists_counts_the_stored_prefix_of_a_long_batch(section):
    backend, pool = make_backend(section, staging="64KiB")  # 8 slots a direction: rounds and jobs
    try:
        pool.fill_random(10)
        ks = keys(40, "long")
        assert backend.batch_set_v1(ks[:16], pages(*range(16))) == [True] * 16
        assert backend.batch_set_v1(ks[16:30], pages(*range(14))) == [True] * 14
        assert backend.batch_exists(ks) == 30
        assert backend.batch_exists(ks[:29] + ks[30:] + ks[29:30]) == 29
        want = [page_bytes(pool, p) for p in range(16)]
        pool.kv_buffer.zero_()
        assert backend.batch_get_v1(ks[16:32], pages(*range(16))) == [True] * 14 + [False] * 2
        assert [page_bytes(pool, p) for p in range(14)] == want[:14]
    finally:
        backend.close()


def test_unsupported_parallelism_is_refused_clearly(tmp_path):
    import dataclasses

    extra = {"backend_name": "kvoffload", "module_path": "kvoffload.integrations.sglang.backend",
             "class_name": "KvoffloadHiCacheStorage", "kvoffload": {"type": "redis"}}
    cfg = storage_config(extra)
    for change, match in (({"should_split_heads": True}, "should_split_heads"),):
        with pytest.raises(ConfigError, match=match):
            StorageBackendFactory.create_backend("dynamic", dataclasses.replace(cfg, **change), None)
    mla_dcp = dataclasses.replace(cfg, is_mla_model=True, tp_size=2, tp_rank=1, dcp_size=2, dcp_rank=1,
                                  logical_page_size=2 * PAGE)
    with pytest.raises(ConfigError, match="dcp_size"):
        StorageBackendFactory.create_backend("dynamic", mla_dcp, None)


def test_wrong_number_of_host_indices_is_refused_before_any_transfer(request, tmp_path, prefix):
    backend, pool = make_backend(tier_section("redis", request, tmp_path, prefix))
    try:
        ks = keys(2, "bad-indices")
        with pytest.raises(ValueError, match="host indices"):
            backend.batch_set_v1(ks, pages(0)[:-1])
        with pytest.raises(ValueError, match="host indices"):
            backend.batch_get_v1(ks, pages(0, 1)[1:])
        assert backend.batch_exists(ks) == 0
        assert backend.batch_set_v1(ks, pages(0, 1)) == [True, True]  # nothing left half done
        assert backend.batch_get_v1(ks, pages(2, 3)) == [True, True]
    finally:
        backend.close()


def test_storage_tier_pages_outlive_the_engine(tmp_path):
    """An SGLang engine restarted on the same directory finds the pages the last one stored."""
    section = {"type": "storage", "path": str(tmp_path / "l3"), "capacity_bytes": "1MiB"}
    first, pool = make_backend(section)
    pool.fill_random(11)
    ks = keys(4, "restart")
    want = [page_bytes(pool, p) for p in range(4)]
    try:
        assert first.batch_set_v1(ks, pages(0, 1, 2, 3)) == [True] * 4
    finally:
        first.close()
    second, pool2 = make_backend(section)
    try:
        assert second.batch_exists(ks) == 4
        assert second.batch_get_v1(ks, pages(4, 5, 6, 7)) == [True] * 4
        assert [page_bytes(pool2, p) for p in (4, 5, 6, 7)] == want
    finally:
        second.close()


def storage_section(tmp_path) -> dict:
    return {"type": "storage", "path": str(tmp_path / "l3"), "capacity_bytes": "1MiB", "direct_io": False}


def settled(backend) -> bool:
    """No storage-tier block left pinned, no job result left uncollected."""
    return backend.io.manager.get_stats().gauges["pinned_blocks"] == 0 and not backend.io._results


def test_host_indices_of_a_wrong_dtype_or_device_are_refused_before_any_load(tmp_path):
    backend, pool = make_backend(storage_section(tmp_path))
    try:
        pool.fill_random(3)
        ks = keys(4, "dtype")
        assert backend.batch_set_v1(ks, pages(0, 1, 2, 3)) == [True] * 4
        for bad in (pages(4, 5, 6, 7).double(), pages(4, 5, 6, 7).to("meta"), pages(4, 5, 6, 7).bool()):
            with pytest.raises(TypeError, match="host_indices must be an integer CPU tensor"):
                backend.batch_get_v1(ks, bad)
            with pytest.raises(TypeError, match="host_indices must be an integer CPU tensor"):
                backend.batch_set_v1(keys(4, "dtype2"), bad)
        assert settled(backend)  # the double ones used to fail in the copy, after the loads: 3 pins left
        assert backend.batch_get_v1(ks, pages(4, 5, 6, 7)) == [True] * 4
    finally:
        backend.close()


OUT_OF_POOL = """
import sys, torch
sys.path.insert(0, {here!r})
from test_sglang_backend import keys, make_backend, pages, storage_section
from pathlib import Path
backend, pool = make_backend(storage_section(Path({tmp!r})))
ks = keys(1, "edge")
assert backend.batch_set_v1(ks, pages(0)) == [True]
for idx in (torch.arange(10**6, 10**6 + 16), torch.arange(pool.size - 8, pool.size + 8), torch.arange(-16, 0)):
    for call in (backend.batch_get_v1, backend.batch_set_v1):
        try:
            call(ks if call == backend.batch_get_v1 else keys(1, "edge2"), idx)
        except ValueError as e:
            assert "outside the host pool" in str(e), e
        else:
            raise AssertionError("not refused")
assert backend.batch_get_v1(ks, pages(1)) == [True]
backend.close()
print("refused")
"""


def test_host_indices_outside_the_pool_are_refused_not_copied(tmp_path):
    """(in a process of its own: the copy to or from an address past the pool was a SIGSEGV)"""
    import subprocess
    import sys

    code = OUT_OF_POOL.format(here=os.path.dirname(__file__), tmp=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "refused" in out.stdout, (out.returncode, out.stderr[-3000:])


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
    from kvoffload.tiers.remote.server import pause, resume

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
