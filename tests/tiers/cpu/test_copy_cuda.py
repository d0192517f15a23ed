"""The CUDA executor's copy logic (copy_cuda.issue over a strided=False
plan) run on CPU tensors, with memmove as the copy primitive in place of
cuMemcpyAsync: streams and events need a GPU, the addresses and the
one-copy-per-merged-range loop do not. Cross-checked against the CPU
executor, which reads the same pool through another path (strided views
for mapped refs)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kvoffload.abstractions import CanonicalPageMapping, CopyRun, CPULoadStoreSpec, GPULoadStoreSpec
from kvoffload.config import OffloadingConfig
from kvoffload.kv_caches import make_kv_caches, random_kv_caches
from kvoffload.tiers.cpu.copy_cuda import issue
from kvoffload.tiers.cpu.plan import LOAD, STORE, CopyPlanner, base_addresses
from kvoffload.tiers.cpu.worker import CPUOffloadingWorker


def config(groups, blocks_per_chunk=1):
    return OffloadingConfig.from_dict({"groups": groups, "tokens_per_hash": 16, "blocks_per_chunk": blocks_per_chunk})


class Recorder:
    """The copy primitive on CPU memory (memmove for cuMemcpyAsync), counting calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, dst: int, src: int, n: int) -> int:
        self.calls += 1
        ctypes.memmove(dst, src, n)
        return 0


@pytest.fixture
def cpu_worker():
    made = []

    def make(kv, cfg, n):
        made.append(CPUOffloadingWorker(kv, cfg, n))
        return made[-1]

    yield make
    for w in made:
        w.shutdown()


def cuda_planner(w: CPUOffloadingWorker) -> CopyPlanner:
    """The planner the CUDA executor gets for this worker's caches and pool."""
    return CopyPlanner(w.kv_caches, w.config, w.layout, w.num_chunks, w.pool.chunk_bytes,
                       shared_pool=False, strided=False)


def wait_ok(w, job_id):
    w.wait({job_id})
    assert all(r.success for r in w.get_finished())


def test_cuda_plan_round_trips_through_the_cpu_executor(cpu_worker):
    # padded pages, a shared tensor, a mapped ref of 4 strided fragments, 2 GPU blocks per chunk
    raw = torch.randint(-128, 128, (24, 3000), dtype=torch.int8)
    tensors = [raw[:, :2048], torch.randint(-128, 128, (24, 1024), dtype=torch.int8)]
    kv = make_kv_caches(tensors, groups=[[0, 1]])
    run = CopyRun(local_offset=0, canonical_offset=256, fragment_size=256, num_fragments=4,
                  local_stride=256, canonical_stride=512)
    kv.group_data_refs[0][1].mapping = CanonicalPageMapping(2048, 1024, (run,), 1, 0, False)
    w = cpu_worker(kv, config([16], blocks_per_chunk=2), 8)
    assert w.planner.strided[0]  # the CPU executor takes the other path for the mapped ref
    p = cuda_planner(w)
    gpu_base, pool_base = base_addresses(kv, w.pool)
    orig, padding = [t.clone() for t in tensors], raw[:, 2048:].clone()

    gpu, cpu = GPULoadStoreSpec([3, 4, 5], block_indices=[1]), CPULoadStoreSpec([6, 2])
    issue(p.plan(1, STORE, p.check(gpu, cpu)), gpu_base, pool_base, Recorder())
    assert w.submit_load(2, cpu, GPULoadStoreSpec([20, 21, 22], block_indices=[1]))  # CPU executor reads it
    wait_ok(w, 2)
    assert w.submit_store(3, GPULoadStoreSpec([7, 8]), CPULoadStoreSpec([5]))  # CPU executor writes
    wait_ok(w, 3)
    issue(p.plan(4, LOAD, p.check(GPULoadStoreSpec([10, 11]), CPULoadStoreSpec([5]))), gpu_base, pool_base, Recorder())
    for a, b in zip(orig, tensors):
        assert torch.equal(b[20:23], a[3:6]) and torch.equal(b[10:12], a[7:9])
        assert torch.equal(b[:10], a[:10])  # nothing else written
    assert torch.equal(raw[:, 2048:], padding)  # padding untouched


def test_one_copy_per_layer_when_blocks_and_slots_are_consecutive(cpu_worker):
    tensors, kv = random_kv_caches(32, [4096, 4096, 4096])  # 3 layers, one slot holds 3 pages
    w = cpu_worker(kv, config([16], blocks_per_chunk=4), 16)
    p, rec = cuda_planner(w), Recorder()
    gpu_base, pool_base = base_addresses(kv, w.pool)
    blocks = GPULoadStoreSpec(list(range(8, 16)))  # 8 blocks = 2 chunks, into slots 5, 6
    n = issue(p.plan(1, STORE, p.check(blocks, CPULoadStoreSpec([5, 6]))), gpu_base, pool_base, rec)
    assert n == rec.calls == 3 * 2  # per chunk one range per layer (layers alternate in a slot)
    orig = [t.clone() for t in tensors]
    for t in tensors:
        t.zero_()
    n = issue(p.plan(2, LOAD, p.check(blocks, CPULoadStoreSpec([5, 6]))), gpu_base, pool_base, rec)
    assert n == 6 and all(torch.equal(a[8:16], b[8:16]) for a, b in zip(orig, tensors))

    _, one_layer = random_kv_caches(32, [4096])
    w1 = cpu_worker(one_layer, config([16]), 16)
    p1 = cuda_planner(w1)
    f1, pf1 = base_addresses(one_layer, w1.pool)
    job = p1.plan(3, STORE, p1.check(GPULoadStoreSpec(list(range(4, 12))), CPULoadStoreSpec(list(range(2, 10)))))
    assert issue(job, f1, pf1, Recorder()) == 1  # the whole job is one copy


def test_issue_refuses_a_plan_with_strided_parts(cpu_worker):
    _, kv = random_kv_caches(8, [1024])
    run = CopyRun(0, 256, 256, 4, 256, 512)
    kv.group_data_refs[0][0].mapping = CanonicalPageMapping(2048, 1024, (run,), 1, 0, False)
    w = cpu_worker(kv, config([16]), 4)
    plan = w.planner.plan(1, STORE, w.planner.check(GPULoadStoreSpec([1]), CPULoadStoreSpec([0])))
    with pytest.raises(ValueError, match="strided"):
        issue(plan, *base_addresses(kv, w.pool), Recorder())


def test_a_failed_copy_raises_naming_the_status(cpu_worker):
    _, kv = random_kv_caches(8, [1024])
    w = cpu_worker(kv, config([16]), 4)
    plan = cuda_planner(w).plan(1, STORE, w.planner.check(GPULoadStoreSpec([1]), CPULoadStoreSpec([0])))
    with pytest.raises(RuntimeError, match="CUresult 1"):
        issue(plan, *base_addresses(kv, w.pool), lambda dst, src, n: 1)
