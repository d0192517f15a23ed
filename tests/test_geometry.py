"""ChunkGeometry is resolved once, from whichever source knows both the
chunk size and the count first: the declaration, the KV caches, or a shared
pool's file; later sources are checked against it."""

from __future__ import annotations

import pytest

from kvoffload.config import ConfigError, OffloadingConfig
from kvoffload.geometry import ChunkGeometry
from kvoffload.kv_caches import random_kv_caches
from kvoffload.tiers.cpu.spec import CPUOffloadingSpec

PAGES = [4096, 4096]  # two layers: 8 KiB per 16-token block


def spec(**extra) -> CPUOffloadingSpec:
    return CPUOffloadingSpec(OffloadingConfig.from_dict({"groups": [16], "extra_config": extra}))


def test_declared_size_and_bytes_resolve_at_construction():
    s = spec(cpu_bytes_to_use=10 * 8192, kv_bytes_per_token=512)
    assert s.geometry == ChunkGeometry(tokens_per_chunk=16, chunk_bytes=8192, num_chunks=10)
    assert s.geometry.slot_bytes == 8192


def test_a_count_alone_waits_for_the_kv_caches():
    s = spec(num_cpu_chunks=3)
    assert s.geometry is None and s.num_chunks == 3 and s.kv_bytes_per_chunk is None
    manager = s.get_manager()  # the count is enough for the manager
    worker = s.get_worker(random_kv_caches(4, PAGES)[1])
    try:
        assert s.geometry == ChunkGeometry(16, 8192, 3)
        assert manager.chunk_bytes == 8192  # its byte counters learn the size
    finally:
        worker.shutdown()


def test_bytes_alone_resolve_from_the_kv_caches():
    s = spec(cpu_bytes_to_use=5 * 8192 + 100)
    worker = s.get_worker(random_kv_caches(4, PAGES)[1])
    try:
        assert s.geometry == ChunkGeometry(16, 8192, 5)
    finally:
        worker.shutdown()


def test_a_pool_file_resolves_a_manager_in_another_process(tmp_path):
    from kvoffload.tiers.host_pool import SharedHostPool

    path = str(tmp_path / "pool")
    pool = SharedHostPool.create(path, 4, 8192)  # what TP rank 0's worker makes
    try:
        scheduler = spec(cpu_bytes_to_use="1MiB", shared_pool_path=path)  # knows neither
        assert scheduler.get_manager().num_chunks == 4
        assert scheduler.geometry == ChunkGeometry(16, 8192, 4)
        wrong = spec(num_cpu_chunks=4, kv_bytes_per_chunk=4096, shared_pool_path=path)
        with pytest.raises(ConfigError, match="declares 4096 KV bytes per chunk, but the shared pool"):
            wrong.take_pool_geometry()
        assert wrong.geometry == ChunkGeometry(16, 4096, 4)  # the declaration stands
    finally:
        pool.close()
