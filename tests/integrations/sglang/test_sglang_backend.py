"""kvoffload's tiers as an SGLang HiCache storage backend, built by SGLang's
own StorageBackendFactory ("dynamic" backend) with its real
HiCacheStorageConfig, on real files, a real redis-server and a real Mooncake
Store: pages round-trip byte for byte, and are shared only between engines
that agree on model, layout and shard. Pages are SGLang host-pool pages
(sglang_pool.py)."""

from __future__ import annotations

import pytest
import torch

from sglang_pool import need_sglang

need_sglang()
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage  # noqa: E402
from sglang_backend_rig import PAGE, keys, make_backend, make_mla_backend, page_bytes, pages, tier_section  # noqa: E402

from kvoffload.integrations.sglang.backend import KvoffloadHiCacheStorage  # noqa: E402
from kvoffload.integrations.sglang.pages import key_bytes  # noqa: E402


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
    from kvoffload.tiers.redis import RemoteTier

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
