"""The tiering manager's own jobs: where their completions are applied, and
a reset racing a worker that reports late."""

from __future__ import annotations

import numpy as np

from kvoffload.abstractions import ReqContext
from tiering_rig import END, HIT, PENDING, LateReports, key, pattern


def test_an_idle_engine_s_queries_apply_finished_jobs(rig):
    """No step comes once no request is left (vLLM 0.32 never asks
    has_pending_work): get_stats alone must count a cascade that landed."""
    r = rig()
    ctx = r.request()
    r.gpu_store([key(0)], ctx)  # cascades: a job in flight
    r.storage.get_worker(r.pool).wait(r.mgr.jobs.ids_of_tier(0))  # finished, not applied yet
    s = r.mgr.get_stats().children[1]
    assert s.counters["cascaded_blocks"] == 1 and s.gauges["queue_depth"] == 0
    assert r.cpu.get_stats().gauges["pinned_blocks"] == 0  # the CPU copy is unpinned
    assert not r.mgr.has_pending_work()


def test_a_cascade_reported_after_a_reset_completes_on_its_tier_only(rig):
    r = rig(cpu_chunks=8)  # both keys in one cascade (at most a quarter of CPU in flight)
    r.mgr.attach_workers([LateReports(r.storage.get_worker(r.pool))])
    ctx = r.request()
    r.gpu_store([key(0), key(1)], ctx)  # cascades to storage: a job in flight
    r.mgr.reset_cache()  # waits for it; the worker reports it only at the next poll
    r.mgr.on_reset_flushed()
    r.mgr.on_schedule_end(END)  # the late report (the CPU tier forgot its keys at the reset): no error
    r.settle()
    assert not r.mgr.has_pending_work()
    assert r.mgr.get_stats().children[1].gauges["queue_depth"] == 0
    # the write landed: the storage tier serves it, promoted into CPU bit-exact
    other = r.request("other")
    assert r.mgr.lookup(key(0), other) is PENDING
    r.settle()
    r.settle()  # (the late reports)
    assert r.mgr.lookup(key(0), other) is HIT
    slot = int(r.mgr.prepare_load([key(0)], other).block_ids[0])
    np.testing.assert_array_equal(r.pool.chunk(slot), pattern(key(0)))
    r.mgr.complete_load([key(0)], other)


def test_a_promotion_reported_after_a_reset_is_a_miss_and_finishes_its_request(rig):
    r = rig(cpu_chunks=2)
    ctx = r.request()
    for i in range(4):  # keys 0, 1 leave CPU, stay in storage
        r.gpu_store([key(i)], ctx)
        r.settle()
    r.mgr.attach_workers([LateReports(r.storage.get_worker(r.pool))])
    want = r.request("w")
    assert r.mgr.lookup(key(0), want) is PENDING
    r.mgr.on_schedule_end(END)  # the promotion job is submitted
    r.mgr.on_request_finished(want)  # finished while its promotion is in flight
    r.mgr.reset_cache()
    r.mgr.on_reset_flushed()
    r.mgr.on_schedule_end(END)  # its late report
    r.settle()
    assert not r.mgr.has_pending_work()
    assert r.mgr.get_stats().children[1].counters["promotion_failures"] == 1
    assert r.tier.manager.lookup(key(0), ReqContext("x")) is HIT  # still held by storage, unpinned
