"""CPUOffloadingWorker: real bytes through a real host pool, compared bit for bit."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.abstractions import (
    CanonicalPageMapping,
    CopyRun,
    CPULoadStoreSpec,
    GPULoadStoreSpec,
)
from kvoffload.config import OffloadingConfig
from kvoffload.kv_caches import make_kv_caches, random_kv_caches
from kvoffload.tiers.cpu.worker import CPUOffloadingWorker, chunk_layout


def config(groups, blocks_per_chunk=1, tokens_per_hash=16):
    return OffloadingConfig.from_dict(
        {"groups": groups, "tokens_per_hash": tokens_per_hash, "blocks_per_chunk": blocks_per_chunk}
    )


def run(worker, job_id, direction, gpu, cpu):
    submit = worker.submit_store if direction == "store" else worker.submit_load
    assert submit(job_id, gpu, cpu) if direction == "store" else submit(job_id, cpu, gpu), worker.last_error
    worker.wait({job_id})
    results = worker.get_finished()
    assert [r.job_id for r in results] == [job_id]
    assert results[0].success
    return results[0]


@pytest.fixture
def worker_factory():
    made = []

    def make(kv, cfg, num_chunks):
        w = CPUOffloadingWorker(kv, cfg, num_chunks)
        made.append(w)
        return w

    yield make
    for w in made:
        w.shutdown()


def test_single_group_round_trip(worker_factory):
    tensors, kv = random_kv_caches(16, [4096, 4096, 4096])
    w = worker_factory(kv, config([16]), 8)
    orig = [t.clone() for t in tensors]
    r = run(w, 1, "store", GPULoadStoreSpec([3, 7, 1]), CPULoadStoreSpec([6, 0, 2]))
    assert r.transfer_size == 3 * 3 * 4096 and r.transfer_time >= 0
    for t in tensors:
        t.zero_()
    run(w, 2, "load", GPULoadStoreSpec([10, 11, 12]), CPULoadStoreSpec([6, 0, 2]))
    for a, b in zip(orig, tensors):
        assert torch.equal(a[[3, 7, 1]], b[[10, 11, 12]])
        assert not b[:10].any()  # nothing else written


def test_pool_layout_is_the_documented_one(worker_factory):
    # group 0: 2 layers, 4 GPU blocks per chunk; group 1: 1 layer, 2 GPU blocks per chunk
    tensors, kv = random_kv_caches(32, [4096, 8192, 1024], groups=[[0, 1], [2]])
    cfg = config([16, 32], blocks_per_chunk=4)
    layout, chunk_bytes = chunk_layout(kv, cfg)
    assert [off for _, off in layout[0]] == [0, 4 * 4096]
    assert [off for _, off in layout[1]] == [0]
    assert chunk_bytes == 4 * 4096 + 4 * 8192
    w = worker_factory(kv, cfg, 4)
    run(w, 1, "store", GPULoadStoreSpec([1, 2, 3, 4, 9, 8], group_sizes=[4, 2], block_indices=[0, 0]),
        CPULoadStoreSpec([2, 1]))
    slot = w.pool.chunk(2)
    for j, b in enumerate([1, 2, 3, 4]):
        assert np.array_equal(slot[j * 4096 : (j + 1) * 4096], tensors[0][b].numpy().view(np.uint8))
        off = 4 * 4096 + j * 8192
        assert np.array_equal(slot[off : off + 8192], tensors[1][b].numpy().view(np.uint8))
    slot = w.pool.chunk(1)
    for j, b in enumerate([9, 8]):
        assert np.array_equal(slot[j * 1024 : (j + 1) * 1024], tensors[2][b].numpy().view(np.uint8))


def test_unaligned_first_block_skips_part_of_first_chunk(worker_factory):
    tensors, kv = random_kv_caches(32, [2048, 512])
    cfg = config([16], blocks_per_chunk=4)  # 4 GPU blocks per chunk
    w = worker_factory(kv, cfg, 4)
    orig = [t.clone() for t in tensors]
    # logical blocks 0..7 = 2 chunks, stored whole
    run(w, 1, "store", GPULoadStoreSpec(list(range(8)), block_indices=[0]), CPULoadStoreSpec([3, 1]))
    # load logical blocks 2..7: skip 2 blocks of chunk slot 3
    run(w, 2, "load", GPULoadStoreSpec(list(range(20, 26)), block_indices=[2]), CPULoadStoreSpec([3, 1]))
    for a, b in zip(orig, tensors):
        assert torch.equal(a[2:8], b[20:26])
    # store logical blocks 5..9 (mid chunk to mid chunk) into fresh slots, load them back elsewhere
    run(w, 3, "store", GPULoadStoreSpec([5, 6, 7, 8, 9], block_indices=[5]), CPULoadStoreSpec([0, 2]))
    run(w, 4, "load", GPULoadStoreSpec([27, 28, 29, 30, 31], block_indices=[5]), CPULoadStoreSpec([0, 2]))
    for a, b in zip(orig, tensors):
        assert torch.equal(a[5:10], b[27:32])


def test_padded_pages_and_shared_tensor(worker_factory):
    # block stride larger than the page (padding), and two layers sharing one tensor
    raw = torch.randint(-128, 128, (16, 3000), dtype=torch.int8)
    padded = raw[:, :2500]
    kv = make_kv_caches([padded, padded, torch.randint(-128, 128, (16, 10, 32), dtype=torch.int16)])
    assert len(kv.tensors) == 2 and kv.tensors[1].page_size_bytes == 640
    w = worker_factory(kv, config([16]), 4)
    before = raw.clone()
    run(w, 1, "store", GPULoadStoreSpec([4, 5]), CPULoadStoreSpec([0, 1]))
    run(w, 2, "load", GPULoadStoreSpec([8, 9]), CPULoadStoreSpec([0, 1]))
    assert torch.equal(raw[8:10, :2500], before[4:6, :2500])
    assert torch.equal(raw[8:10, 2500:], before[8:10, 2500:])  # padding untouched


def test_mapping_copies_through_copy_runs(worker_factory):
    # local page of 1024 B = 4 fragments of 256 B; canonical page of 2048 B
    # holds them at stride 512 (the other halves would come from another rank)
    tensors, kv = random_kv_caches(8, [1024])
    run_ = CopyRun(local_offset=0, canonical_offset=256, fragment_size=256, num_fragments=4,
                   local_stride=256, canonical_stride=512)
    kv.group_data_refs[0][0].mapping = CanonicalPageMapping(2048, 1024, (run_,), 1, 0, False)
    w = worker_factory(kv, config([16]), 2)
    assert w.chunk_bytes == 2048
    orig = tensors[0].clone()
    run(w, 1, "store", GPULoadStoreSpec([3]), CPULoadStoreSpec([1]))
    slot = w.pool.chunk(1)
    for i in range(4):
        frag = orig[3, i * 256 : (i + 1) * 256].numpy().view(np.uint8)
        assert np.array_equal(slot[256 + i * 512 : 512 + i * 512], frag)
    run(w, 2, "load", GPULoadStoreSpec([6]), CPULoadStoreSpec([1]))
    assert torch.equal(tensors[0][6], orig[3])


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_round_trip_property(data):
    """Random groups, pages, chunk factors and unaligned starts round-trip bit-exactly."""
    num_groups = data.draw(st.integers(1, 3))
    bpc = data.draw(st.sampled_from([1, 2, 4]))
    tph = 16
    tpbs = [data.draw(st.sampled_from([t for t in (16, 32, 64) if t <= tph * bpc])) for _ in range(num_groups)]
    layers = [data.draw(st.integers(1, 3)) for _ in range(num_groups)]
    pages = [data.draw(st.sampled_from([64, 256, 1000, 4096])) for _ in range(sum(layers))]
    groups, i = [], 0
    for n in layers:
        groups.append(list(range(i, i + n)))
        i += n
    num_blocks = 48  # room for 3 groups x (8 source + 8 destination) blocks
    tensors, kv = random_kv_caches(num_blocks, pages, groups=groups, seed=data.draw(st.integers(0, 99)))
    cfg = config(tpbs, blocks_per_chunk=bpc, tokens_per_hash=tph)
    w = CPUOffloadingWorker(kv, cfg, 24)
    try:
        orig = [t.clone() for t in tensors]
        src_ids, dst_ids, sizes, firsts, n_chunks = [], [], [], [], 0
        free = list(range(num_blocks))
        for g in range(num_groups):
            k = cfg.gpu_blocks_per_chunk(g)
            first = data.draw(st.integers(0, 2 * k))
            n = data.draw(st.integers(0, 8 // k * k))
            picks = data.draw(st.permutations(free))[: 2 * n]
            free = [b for b in free if b not in picks]
            src_ids += picks[:n]
            dst_ids += picks[n:]
            sizes.append(n)
            firsts.append(first)
            n_chunks += -(-(first % k + n) // k)
        slots = data.draw(st.permutations(range(24)))[:n_chunks]
        run(w, 1, "store", GPULoadStoreSpec(src_ids, sizes, firsts), CPULoadStoreSpec(slots))
        run(w, 2, "load", GPULoadStoreSpec(dst_ids, sizes, firsts), CPULoadStoreSpec(slots))
        start = 0
        for g, n in enumerate(sizes):
            for layer in groups[g]:
                assert torch.equal(tensors[layer][dst_ids[start : start + n]],
                                   orig[layer][src_ids[start : start + n]])
            start += n
    finally:
        w.shutdown()


def test_bad_specs_are_refused_and_change_nothing(worker_factory):
    tensors, kv = random_kv_caches(8, [512])
    w = worker_factory(kv, config([16]), 4)
    before = w.pool.array.copy()
    bad = [
        (GPULoadStoreSpec([1, 2]), CPULoadStoreSpec([0])),  # slot count mismatch
        (GPULoadStoreSpec([8]), CPULoadStoreSpec([0])),  # GPU block out of range
        (GPULoadStoreSpec([-1]), CPULoadStoreSpec([0])),
        (GPULoadStoreSpec([1]), CPULoadStoreSpec([4])),  # slot out of range
        (GPULoadStoreSpec([1, 2], group_sizes=[1, 1]), CPULoadStoreSpec([0, 1])),  # two groups, one configured
        (CPULoadStoreSpec([1]), CPULoadStoreSpec([0])),  # wrong spec type
    ]
    for i, (gpu, cpu) in enumerate(bad):
        assert not w.submit_store(i, gpu, cpu)
        assert w.last_error and f"job {i}" in w.last_error
    assert w.get_finished() == []
    assert np.array_equal(w.pool.array, before)


def test_empty_job_finishes_with_zero_bytes(worker_factory):
    _, kv = random_kv_caches(4, [512])
    w = worker_factory(kv, config([16]), 2)
    r = run(w, 5, "store", GPULoadStoreSpec([]), CPULoadStoreSpec([]))
    assert r.transfer_size == 0


def test_failed_job_reports_failure_and_thread_survives(worker_factory, monkeypatch):
    tensors, kv = random_kv_caches(8, [512])
    w = worker_factory(kv, config([16]), 4)
    real_copy = w.copier.copy

    def flaky(job):
        if job.job_id == 1:
            raise OSError("injected copy failure")
        real_copy(job)

    monkeypatch.setattr(w.copier, "copy", flaky)
    assert w.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([0]))
    w.wait({1})
    [r] = w.get_finished()
    assert (r.job_id, r.success, r.transfer_size) == (1, False, 0)
    run(w, 2, "store", GPULoadStoreSpec([2]), CPULoadStoreSpec([1]))
    assert np.array_equal(w.pool.chunk(1)[:512], tensors[0][2].numpy().view(np.uint8))


def test_duplicate_in_flight_job_id_refused(worker_factory, monkeypatch):
    _, kv = random_kv_caches(8, [512])
    w = worker_factory(kv, config([16]), 4)
    gate = threading.Event()
    real_copy = w.copier.copy
    # the copy waits for the gate however loaded the machine (a bounded wait
    # could let job 1 finish before the duplicate is submitted)
    monkeypatch.setattr(w.copier, "copy", lambda job: (gate.wait(), real_copy(job)))
    try:
        assert w.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([0]))
        assert not w.submit_store(1, GPULoadStoreSpec([2]), CPULoadStoreSpec([1]))
        assert "already in flight" in w.last_error
    finally:
        gate.set()
    w.wait({1})
    assert [r.success for r in w.get_finished()] == [True]


def test_many_jobs_finish_in_order_and_wait_blocks(worker_factory):
    tensors, kv = random_kv_caches(64, [8192, 8192])
    w = worker_factory(kv, config([16]), 64)
    for j in range(32):
        assert w.submit_store(j, GPULoadStoreSpec([j, j + 32]), CPULoadStoreSpec([2 * j, 2 * j + 1]))
    w.wait({31})  # one thread, FIFO: everything before 31 is done too
    results = w.get_finished()
    assert [r.job_id for r in results] == list(range(32))
    assert all(r.success and r.transfer_size == 2 * 2 * 8192 for r in results)
    w.wait({999})  # unknown job: nothing to wait for
    assert w.get_finished() == []


def test_shutdown_finishes_submitted_jobs_then_refuses(worker_factory):
    tensors, kv = random_kv_caches(16, [4096])
    w = worker_factory(kv, config([16]), 16)
    for j in range(8):
        assert w.submit_store(j, GPULoadStoreSpec([j]), CPULoadStoreSpec([j]))
    w.shutdown()
    assert len(w.get_finished()) == 8
    assert not w.submit_store(9, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))
    assert not w.submit_load(10, CPULoadStoreSpec([1]), GPULoadStoreSpec([1]))
    w.shutdown()  # idempotent


def test_rejects_bad_kv_caches():
    cfg = config([16])
    t = torch.zeros(8, 128, dtype=torch.float16)
    from kvoffload.abstractions import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor

    with pytest.raises(ValueError, match="1-byte"):
        CPUOffloadingWorker(CanonicalKVCaches([CanonicalKVCacheTensor(t, 256)], [[CanonicalKVCacheRef(0, 256)]]),
                            cfg, 2)
    with pytest.raises(ValueError, match="KV groups"):
        CPUOffloadingWorker(random_kv_caches(4, [64])[1], config([16, 16]), 2)
    with pytest.raises(ValueError, match="larger than a chunk"):
        CPUOffloadingWorker(random_kv_caches(4, [64])[1], config([32], tokens_per_hash=16), 2)
    with pytest.raises(ValueError, match="no pages"):
        CPUOffloadingWorker(make_kv_caches([], [[]]), cfg, 2)


def test_zero_chunks_refused():
    with pytest.raises(ValueError, match="host pool"):
        CPUOffloadingWorker(random_kv_caches(4, [64])[1], config([16]), 0)


def test_concurrent_submitters(worker_factory):
    tensors, kv = random_kv_caches(64, [1024, 2048])
    w = worker_factory(kv, config([16]), 64)
    orig = [t.clone() for t in tensors]

    def submit(base):
        for j in range(16):
            b = base * 16 + j
            assert w.submit_store(b, GPULoadStoreSpec([b]), CPULoadStoreSpec([63 - b]))

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    w.wait(set(range(64)))
    assert sorted(r.job_id for r in w.get_finished()) == list(range(64))
    for t in tensors:
        t.zero_()
    assert w.submit_load(100, CPULoadStoreSpec([63 - b for b in range(64)]), GPULoadStoreSpec(range(64)))
    w.wait({100})
    assert all(r.success for r in w.get_finished())
    assert all(torch.equal(a, b) for a, b in zip(orig, tensors))
