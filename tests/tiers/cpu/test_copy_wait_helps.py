"""A wait() on jobs still queued copies them in the waiting thread (the CPU
copier's poll with block_on), in submission order, up to the last job it
waits for; the bytes and the reports are those of the copy thread."""

from __future__ import annotations

import threading
import time

import numpy as np
import torch

from kvoffload.abstractions import CPULoadStoreSpec, GPULoadStoreSpec
from kvoffload.config import OffloadingConfig
from kvoffload.kv_caches import make_kv_caches
from kvoffload.tiers.cpu.copy_cpu import CPUCopier
from kvoffload.tiers.cpu.worker import CPUOffloadingWorker

CONFIG = OffloadingConfig.from_dict({"groups": [16], "tokens_per_hash": 16})


def stalled_worker(page: int, blocks: int, slots: int, monkeypatch):
    """A worker whose copy thread takes no job until `go` is set, and a log
    of (job id, thread name) of every job copied."""
    t = torch.randint(-128, 128, (blocks, page), dtype=torch.int8, generator=torch.Generator().manual_seed(page))
    go, log = threading.Event(), []
    run = CPUCopier._run
    monkeypatch.setattr(CPUCopier, "_run", lambda self: (go.wait(), run(self)))  # the thread's loop
    w = CPUOffloadingWorker(make_kv_caches([t]), CONFIG, slots)
    do = w.copier._do
    monkeypatch.setattr(w.copier, "_do", lambda *job, **kw: (log.append((job[0], threading.current_thread().name)),
                                                            do(*job, **kw)))
    return w, t, go, log


def test_wait_copies_the_queued_jobs_up_to_its_own_in_the_waiting_thread(monkeypatch):
    w, t, go, log = stalled_worker(64 * 1024, 16, 16, monkeypatch)  # memmove path
    # should the wait not copy, the thread does after a while, and the log says so (no hang)
    unstall = threading.Timer(30, go.set)
    unstall.start()
    try:
        for j in range(4):
            assert w.submit_store(j, GPULoadStoreSpec([j]), CPULoadStoreSpec([j + 8])), w.last_error
        w.wait({1})  # jobs 0 and 1, in order, here; 2 and 3 stay queued
        me = threading.current_thread().name
        assert log == [(0, me), (1, me)]
        assert [(r.job_id, r.success, r.transfer_size) for r in w.get_finished()] == [(0, True, 65536), (1, True, 65536)]
        for j in (0, 1):
            assert np.array_equal(w.pool.chunk(j + 8)[: 64 * 1024], t[j].numpy().view(np.uint8))
        go.set()  # the rest is the copy thread's, with no other submit or wait to wake it
        done, deadline = [], time.monotonic() + 60  # a hang guard, not a speed limit
        while len(done) < 2 and time.monotonic() < deadline:
            done += w.get_finished()
            time.sleep(0.005)
        assert [r.job_id for r in done] == [2, 3]
        assert log[2:] == [(2, "kvoffload-cpu-copy"), (3, "kvoffload-cpu-copy")]
        assert np.array_equal(w.pool.array[10:12, : 64 * 1024], t[2:4].numpy().view(np.uint8))
    finally:
        unstall.cancel()
        go.set()
        w.shutdown()


def test_a_waiter_keeps_submission_order_between_dependent_jobs(monkeypatch):
    # store blocks into slots, load them back elsewhere, store over the slots
    # again: waiting on the last runs all three in this order
    w, t, go, log = stalled_worker(1024, 96, 32, monkeypatch)  # gather path (many 1 KiB ranges)
    unstall = threading.Timer(30, go.set)  # as above: no hang should the wait not copy
    unstall.start()
    try:
        rng = np.random.default_rng(5)
        blocks, slots = rng.permutation(32)[:20], rng.permutation(32)[:20]
        first = t[torch.from_numpy(blocks)].clone()
        assert w.submit_store(1, GPULoadStoreSpec(blocks), CPULoadStoreSpec(slots))
        assert w.submit_load(2, CPULoadStoreSpec(slots), GPULoadStoreSpec(blocks + 64))
        assert w.submit_store(3, GPULoadStoreSpec(blocks + 32), CPULoadStoreSpec(slots))
        w.wait({3})
        assert log == [(j, threading.current_thread().name) for j in (1, 2, 3)]
        assert all(r.success for r in w.get_finished())
        assert torch.equal(t[torch.from_numpy(blocks + 64)], first)
        assert torch.equal(w.pool.tensor[torch.from_numpy(slots), :1024].view(torch.int8),
                           t[torch.from_numpy(blocks + 32)])
    finally:
        unstall.cancel()
        go.set()
        w.shutdown()


def test_a_waiter_does_not_copy_while_the_thread_does(monkeypatch):
    w, t, go, log = stalled_worker(4096, 16, 16, monkeypatch)
    gate, inside = threading.Event(), threading.Event()
    real_copy = w.copier.copy

    def held(plan):  # job 0 holds the copy thread until the gate opens
        if plan.job_id == 0:
            inside.set()
            gate.wait()
        real_copy(plan)

    monkeypatch.setattr(w.copier, "copy", held)
    try:
        go.set()
        assert w.submit_store(0, GPULoadStoreSpec([0]), CPULoadStoreSpec([0]))
        assert inside.wait(60)  # the thread is inside job 0
        assert w.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))
        waiter = threading.Thread(target=w.wait, args=({1},))
        waiter.start()
        gate.set()
        waiter.join()
        assert log == [(0, "kvoffload-cpu-copy"), (1, "kvoffload-cpu-copy")]
        assert [r.job_id for r in w.get_finished()] == [0, 1]
    finally:
        gate.set()
        w.shutdown()
