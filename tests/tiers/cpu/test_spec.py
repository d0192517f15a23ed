"""CPUOffloadingSpec: config in, a working manager + worker pair out."""

from __future__ import annotations

import pytest
import torch

from kvoffload.abstractions import CPULoadStoreSpec, GPULoadStoreSpec, LookupResult, ReqContext
from kvoffload.config import ConfigError, OffloadingConfig
from kvoffload.keys import make_offload_key
from kvoffload.kv_caches import random_kv_caches
from kvoffload.spec import build_spec, get_spec_class
from kvoffload.tiers.cpu.manager import CPUOffloadingManager
from kvoffload.tiers.cpu.spec import CPUOffloadingSpec
from kvoffload.tiers.cpu.worker import CPUOffloadingWorker


def cfg(extra, **top):
    return OffloadingConfig.from_dict({"groups": [16], "tokens_per_hash": 16, "extra_config": extra, **top})


PAGES = [4096, 4096]  # two layers: 8 KiB per 16-token block, 512 B per token


def test_registered_as_cpu():
    assert get_spec_class("cpu") is CPUOffloadingSpec


def test_manager_and_worker_from_bytes_and_bytes_per_token():
    spec = build_spec("cpu", cfg({"cpu_bytes_to_use": "1MiB", "kv_bytes_per_token": 512, "block_size": 32}))
    assert spec.blocks_per_chunk == 2 and spec.config.cache.blocks_per_chunk == 2
    manager = spec.get_manager()
    assert isinstance(manager, CPUOffloadingManager)
    assert manager.num_chunks == (1 << 20) // (2 * 8192) == 64
    assert spec.get_manager() is manager  # one per spec
    tensors, kv = random_kv_caches(16, PAGES)
    worker = spec.get_worker(kv)
    try:
        assert isinstance(worker, CPUOffloadingWorker) and worker.pool.num_chunks == 64
        # one store + load through the pair
        ctx = ReqContext("r")
        key = make_offload_key(b"h" * 8, 0)
        out = manager.prepare_store([key], ctx)
        assert worker.submit_store(1, GPULoadStoreSpec([4, 5]), out.store_spec)
        worker.wait({1})
        assert worker.get_finished()[0].success
        manager.complete_store([key], ctx)
        assert manager.lookup(key, ctx) == LookupResult.HIT
        load = manager.prepare_load([key], ctx)
        assert isinstance(load, CPULoadStoreSpec)
        assert worker.submit_load(2, load, GPULoadStoreSpec([9, 10]))
        worker.wait({2})
        manager.complete_load([key], ctx)
        for t in tensors:
            assert torch.equal(t[4:6], t[9:11])
    finally:
        worker.shutdown()


def test_num_cpu_chunks_and_policy():
    spec = CPUOffloadingSpec(cfg({"num_cpu_chunks": 7, "eviction_policy": "arc"}))
    assert spec.get_manager().num_chunks == 7
    w = spec.get_worker(random_kv_caches(4, PAGES)[1])
    assert w.pool.num_chunks == 7
    w.shutdown()


def test_bytes_only_needs_worker_first():
    spec = CPUOffloadingSpec(cfg({"cpu_bytes_to_use": 10 * 8192}))
    with pytest.raises(ConfigError, match="kv_bytes_per_chunk"):
        spec.get_manager()
    w = spec.get_worker(random_kv_caches(4, PAGES)[1])
    assert spec.get_manager().num_chunks == w.pool.num_chunks == 10
    assert spec.get_manager().chunk_bytes == 8192
    w.shutdown()


def test_declared_chunk_size_checked_against_kv_caches():
    spec = CPUOffloadingSpec(cfg({"cpu_bytes_to_use": "1MiB", "kv_bytes_per_chunk": 4096}))
    spec.get_manager()
    with pytest.raises(ConfigError, match="declares 4096 KV bytes per chunk.*8192"):
        spec.get_worker(random_kv_caches(4, PAGES)[1])


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"cpu_bytes_to_use": "1GiB", "cpu_byte_to_use": 1}, "cpu_byte_to_use"),
        ({"cpu_bytes_to_use": 0}, "cpu_bytes_to_use"),
        ({"cpu_bytes_to_use": -5}, "cpu_bytes_to_use"),
        ({"cpu_bytes_to_use": "lots"}, "cpu_bytes_to_use"),
        ({"num_cpu_chunks": 0}, "num_cpu_chunks"),
        ({"num_cpu_chunks": -1}, "num_cpu_chunks"),
        ({"num_cpu_chunks": 2.5}, "num_cpu_chunks"),
        ({"num_cpu_chunks": 4, "cpu_bytes_to_use": "1GiB"}, "not both"),
        ({}, "cpu_bytes_to_use"),
        ({"num_cpu_chunks": 4, "eviction_policy": "fifo"}, "fifo"),
        ({"num_cpu_chunks": 4, "block_size": 24}, "block_size"),
        ({"num_cpu_chunks": 4, "block_size": 0}, "block_size"),
        ({"cpu_bytes_to_use": 100, "kv_bytes_per_chunk": 8192}, "holds no chunk"),
        ({"cpu_bytes_to_use": "1GiB", "kv_bytes_per_chunk": 1, "kv_bytes_per_token": 1}, "not both"),
        ({"cpu_bytes_to_use": "1GiB", "kv_bytes_per_token": 0}, "kv_bytes_per_token"),
    ],
)
def test_bad_extra_config(extra, match):
    with pytest.raises(ConfigError, match=match):
        CPUOffloadingSpec(cfg(extra))


def test_sizes_larger_than_memory_are_refused_before_allocating():
    """Refused at construction, naming the size asked and the memory
    available, before any pool or manager exists."""
    from kvoffload.config import memory_available

    avail = memory_available()
    if avail >= 2**40:
        pytest.skip("this machine has 1 TiB available")
    for extra, asked in (({"cpu_bytes_to_use": "1TiB"}, "cpu_bytes_to_use=1099511627776 needs 1099511627776 bytes"),
                         ({"num_cpu_chunks": 10**11}, "a CPU tier of 100000000000 chunks needs 6400000000000 bytes"),
                         ({"num_cpu_chunks": 2**27, "kv_bytes_per_chunk": "1MiB"},
                          f"a CPU tier of {2**27} chunks of 1048576 bytes needs")):
        with pytest.raises(ConfigError) as e:
            CPUOffloadingSpec(cfg(extra))
        assert str(e.value).startswith(asked) and str(e.value).endswith(" of memory available")
    with pytest.raises(ConfigError, match=r"^num_cpu_chunks must be a positive integer, got '1e11'$"):
        CPUOffloadingSpec(cfg({"num_cpu_chunks": "1e11"}))  # YAML reads 1e11 as a string


def test_pool_sized_by_the_kv_caches_is_checked_at_get_worker():
    """num_cpu_chunks without a chunk size: the pool's size is known once the
    KV caches are; it is checked then, before the pool is allocated."""
    from kvoffload.config import memory_available

    chunks = 2**22  # 4 Mi chunks: 256 MiB of manager slots, 32 TiB of 8 KiB chunks
    if memory_available() >= chunks * (8192 + 64):
        pytest.skip("this machine has 32 TiB available")
    spec = CPUOffloadingSpec(cfg({"num_cpu_chunks": chunks}))
    _, kv = random_kv_caches(4, PAGES)
    with pytest.raises(ConfigError, match=rf"^a CPU tier of {chunks} chunks of 8192 bytes needs "):
        spec.get_worker(kv)
    assert spec.shared_pool is None and spec._worker is None


def test_block_size_conflicting_with_blocks_per_chunk():
    with pytest.raises(ConfigError, match="blocks_per_chunk=4 was given"):
        CPUOffloadingSpec(cfg({"num_cpu_chunks": 4, "block_size": 32}, blocks_per_chunk=4))
    spec = CPUOffloadingSpec(cfg({"num_cpu_chunks": 4, "block_size": 64}, blocks_per_chunk=4))
    assert spec.blocks_per_chunk == 4


def test_flags_and_events():
    spec = CPUOffloadingSpec(cfg({"num_cpu_chunks": 4, "offload_prompt_only": False,
                                  "self_describing_kv_events": True}, enable_kv_cache_events=True))
    assert spec.offload_prompt_only is False
    assert spec.kv_events_config.self_describing_kv_events is True
    m = spec.get_manager()
    key = make_offload_key(b"k" * 8, 0)
    ctx = ReqContext("r")
    m.prepare_store([key], ctx)
    m.complete_store([key], ctx)
    assert any(key in e.keys and not e.removed for e in m.take_events())


def test_demo_runs_and_verifies(capsys):
    from kvoffload.cli import main

    assert main(["demo", "--layers", "2", "--page-kib", "4"]) == 0
    out = capsys.readouterr().out
    assert "evicted 4 to make room: A[7] A[6] A[5] A[4]" in out
    assert "request A again: 4/8 chunks hit" in out and "request B again: 8/8 chunks hit" in out
    assert "verified" in out
