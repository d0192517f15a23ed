"""The composing manager over a real CPU manager, a real host pool and a real
storage tier on files: cascades, promotions, filters, admission, back-pressure."""

from __future__ import annotations

import numpy as np
import pytest

from kvoffload.abstractions import Medium, OffloadPolicy, ReqContext, RequestOffloadingContext
from kvoffload.tiers.storage.manager import StorageOffloadingManager
from kvoffload.tiers.storage.tier import StorageTier
from tiering_rig import HIT, MISS, PENDING, Rig, key, pattern


def test_stores_cascade_to_storage_and_unpin_cpu(rig):
    r = rig()
    ctx = r.request()
    keys = [key(i) for i in range(3)]
    r.gpu_store(keys, ctx)
    assert len(list(r.mgr.jobs)) == 1  # one cascade job (whether it landed yet is thread timing)
    r.settle()
    assert not r.mgr.has_pending_work()
    sm = r.storage.get_manager()
    assert [sm.lookup(k, ctx) for k in keys] == [HIT] * 3
    assert r.cpu.get_stats().gauges["pinned_blocks"] == 0


def test_a_cascade_is_not_a_load_from_cpu_nor_a_use_by_the_request(rig):
    """Copying blocks down to storage reads them from CPU but serves nothing:
    the CPU tier counts no load (it did, so vllm:kvoffload_loaded_blocks[cpu]
    also counted every cascaded block, in whichever engine step polled the
    copy), and the policy sees no load by the storing request (hubchain held
    such keys as a running request's loaded head)."""
    r = rig(policy="hubchain")
    ctx = r.request()
    keys = [key(i) for i in range(3)]
    r.gpu_store(keys, ctx)
    r.settle()  # the cascade landed; the request is still running
    cpu, storage = r.mgr.get_stats().children  # (counts since the last get_stats)
    assert storage.counters["cascaded_blocks"] == 3
    assert cpu.counters["loaded_blocks"] == 0 and cpu.gauges["pinned_blocks"] == 0
    assert not r.cpu.policy._held
    other = r.request("s")  # a real load: counted, and held for its request
    r.mgr.prepare_load(keys, other)
    r.mgr.complete_load(keys, other)
    assert r.mgr.get_stats().children[0].counters["loaded_blocks"] == 3
    assert r.cpu.policy._held == set(keys)


def test_cpu_miss_promotes_from_storage_bit_exact(rig):
    r = rig(cpu_chunks=4)
    ctx = r.request()
    keys = [key(i) for i in range(8)]
    for k in keys:  # one at a time so CPU evicts the oldest
        r.gpu_store([k], ctx)
        r.settle()
    assert r.mgr.lookup(keys[0], ctx) is PENDING  # evicted from CPU, held by storage
    assert r.mgr.has_pending_work()
    r.settle()
    assert r.mgr.lookup(keys[0], ctx) is HIT
    slot = int(r.mgr.prepare_load([keys[0]], ctx).block_ids[0])
    np.testing.assert_array_equal(r.pool.chunk(slot), pattern(keys[0]))
    r.mgr.complete_load([keys[0]], ctx)
    stats = r.mgr.get_stats()
    assert stats.children[1].counters["promoted_blocks"] == 1
    assert stats.counters["hits_pending"] == 1


def test_promotion_without_a_free_cpu_slot_is_a_miss(rig):
    r = rig(cpu_chunks=2)
    ctx = r.request()
    for i in range(4):
        r.gpu_store([key(i)], ctx)
        r.settle()
    r.mgr.prepare_load([key(2), key(3)], ctx)  # pin all of CPU
    assert r.mgr.lookup(key(0), ctx) is PENDING
    r.settle()
    assert r.mgr.lookup(key(0), ctx) is MISS
    r.mgr.complete_load([key(2), key(3)], ctx)


def test_tier_filter_from_kv_transfer_params(rig):
    r = rig(cpu_chunks=1)
    ctx = r.request()
    r.gpu_store([key(0)], ctx)
    r.settle()
    r.gpu_store([key(1)], ctx)  # evicts key 0 from CPU
    r.settle()
    cpu_only = r.request("a", kv_load_tiers=[{"medium": "cpu"}])
    assert r.mgr.lookup(key(0), cpu_only) is MISS
    local_storage = r.request("b", kv_load_tiers=[{"medium": "STORAGE", "locality": "LOCAL"}])
    assert r.mgr.lookup(key(0), local_storage) is PENDING
    # an invalid filter is ignored (counted once, by the tiering manager): every tier may serve
    for bad in ([{"medium": "tape"}], {"medium": "CPU"}, "cpu", [{"medium": "cpu"}, "storage"]):
        assert r.mgr.lookup(key(0), r.request(f"bad {bad}", kv_load_tiers=bad)) is PENDING
    stats = r.mgr.get_stats()
    assert stats.counters["bad_request_hints"] == 4
    assert all(c.counters.get("bad_request_hints", 0) == 0 for c in stats.children)


def test_events_carry_medium_locality_and_owner(rig):
    r = rig(events=True)
    ctx = r.request()
    r.gpu_store([key(0)], ctx)
    r.settle()
    events = list(r.mgr.take_events())
    cpu = [e for e in events if e.medium is Medium.CPU]
    st = [e for e in events if e.medium is Medium.STORAGE]
    assert cpu and all(e.ownership is None for e in cpu)
    assert st and all(e.ownership == "storage" and not e.removed and e.keys == [key(0)] for e in st)
    assert list(r.mgr.take_events()) == []


class _RequestLevelManager(StorageOffloadingManager):
    def on_new_request(self, req_context):
        return RequestOffloadingContext(OffloadPolicy.REQUEST_LEVEL)


class _RequestLevelTier(StorageTier):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self._manager = _RequestLevelManager(self.store, name=self.name)


def test_request_level_tier_receives_resident_chunks(rig):
    r = rig(tier_cls=_RequestLevelTier, store_threshold=5)  # threshold keeps the normal path out
    ctx = r.request()
    assert r.mgr.on_new_request(ReqContext("x")).policy is OffloadPolicy.REQUEST_LEVEL
    r.gpu_store([key(0)], ctx)
    r.settle()
    sm = r.storage.get_manager()
    assert sm.lookup(key(0), ctx) is MISS
    r.mgr.prepare_store([key(0), key(1)], ctx)  # key 0 already resident: goes down now
    r.settle()
    assert sm.lookup(key(0), ctx) is HIT


def test_restart_serves_from_storage(tmp_path):
    r = Rig(tmp_path, cpu_chunks=4)
    ctx = r.request()
    r.gpu_store([key(0), key(1)], ctx)
    r.settle()
    r.close()
    r2 = Rig(tmp_path, cpu_chunks=4)  # a fresh CPU tier, the same directory
    try:
        ctx = r2.request()
        assert r2.mgr.lookup(key(1), ctx) is PENDING
        r2.settle()
        assert r2.mgr.lookup(key(1), ctx) is HIT
        slot = int(r2.mgr.prepare_load([key(1)], ctx).block_ids[0])
        np.testing.assert_array_equal(r2.pool.chunk(slot), pattern(key(1)))
        r2.mgr.complete_load([key(1)], ctx)
    finally:
        r2.close()


def test_promotions_do_not_evict_the_requests_own_cpu_hits(rig):
    r = rig(cpu_chunks=3)
    ctx = r.request()
    keys = [key(i) for i in range(5)]
    for k in keys:
        r.gpu_store([k], ctx)
        r.settle()
    r.mgr.touch([keys[2]], ctx)  # CPU holds 3, 4, 2 (least recent first)
    # a request wants 3, 4, 0: the promotion of 0 must evict 2, not the request's own 3
    want = r.request("w")
    assert [r.mgr.lookup(k, want) for k in (keys[3], keys[4], keys[0])] == [HIT, HIT, PENDING]
    r.settle()
    assert [r.mgr.lookup(k, want) for k in (keys[3], keys[4], keys[0])] == [HIT, HIT, HIT]


def test_one_secondary_hit_promotes_the_rest_of_the_prefix(rig):
    r = rig(cpu_chunks=8)
    ctx = r.request()
    keys = [key(i) for i in range(4)]
    r.gpu_store(keys, ctx)
    r.settle()
    for i in range(10, 18):  # push the prefix out of CPU (it stays in storage)
        r.gpu_store([key(i)], ctx)
        r.settle()
    assert all(r.cpu.slot_of(k) is None for k in keys)
    again = r.request("again")
    for pos, k in enumerate(keys):
        again.set_offload_key_position(k, (pos + 1) * 16)
    assert r.mgr.lookup(keys[0], again) is PENDING
    r.settle()  # one step: the whole prefix lands, not just the first block
    assert [r.mgr.lookup(k, again) for k in keys] == [HIT] * 4
    slots = r.mgr.prepare_load(keys, again).block_ids
    for k, slot in zip(keys, slots):
        np.testing.assert_array_equal(r.pool.chunk(int(slot)), pattern(k))
    r.mgr.complete_load(keys, again)


def test_a_promotion_is_held_for_its_request_until_it_loads(rig):
    """What was promoted for a request stays in CPU until it loads it: else
    other requests' promotions (or stores) may evict it first, and two
    requests whose prefixes do not fit in CPU together took turns evicting
    each other's promotions, so vLLM's scheduler retried both forever (a
    chat replay spun 22 s on one request, one chunk promoted 2,901 times).
    Holds take at most half of CPU, so stores always find room: a request
    holding nothing waits for room (HIT_PENDING), one holding some gets no
    more (MISS)."""
    r = rig(cpu_chunks=4)
    writer = r.request("w")
    a_keys, b_key = [key(0), key(1), key(2)], key(10)
    r.in_storage_only(writer, a_keys + [b_key], [key(i) for i in range(20, 24)])
    a, b = r.request("a"), r.request("b")
    for pos, k in enumerate(a_keys):
        a.set_offload_key_position(k, (pos + 1) * 16)
    assert r.mgr.lookup(a_keys[0], a) is PENDING
    r.settle()  # two of a's prefix land in CPU (half of it), held for a
    for i in range(30, 34):  # the engine stores on: only the two other slots turn over
        r.gpu_store([key(i)], writer)
        r.settle()
    assert [r.mgr.lookup(k, a) for k in a_keys] == [HIT, HIT, MISS]  # a has its share
    assert r.mgr.lookup(b_key, b) is PENDING
    r.settle()
    assert r.mgr.lookup(b_key, b) is PENDING  # b waits: a's holds fill the half
    r.mgr.prepare_load(a_keys[:2], a)  # a's load pins them; the hold is dropped
    assert r.cpu.get_stats().gauges["pinned_blocks"] == 2
    r.mgr.complete_load(a_keys[:2], a)
    assert r.mgr.lookup(b_key, b) is PENDING  # room again: b's promotion goes
    r.settle()
    assert r.mgr.lookup(b_key, b) is HIT
    r.mgr.on_request_finished(a)
    r.mgr.on_request_finished(b)  # b never loaded it: released
    assert r.cpu.get_stats().gauges["pinned_blocks"] == 0
    assert not r.mgr.tracks("a") and not r.mgr.tracks("b")
    assert r.mgr.promotions.holding == 0


def test_a_finished_request_releases_what_it_never_loaded(rig):
    r = rig(cpu_chunks=4)
    a = _promoted_and_held(r)
    assert r.cpu.get_stats().gauges["pinned_blocks"] == 1
    r.mgr.on_request_finished(a)
    assert r.cpu.get_stats().gauges["pinned_blocks"] == 0


def test_every_stat_the_tiered_manager_reports_is_a_declared_series(rig):
    """vLLM exports only the series a spec declares (convert.connector_stats
    leaves the others out): promotions, cascades and head stores must be
    declared, or they vanish inside vLLM."""
    from kvoffload.metrics import COUNTERS, GAUGES

    r = rig(cpu_chunks=4)
    a = _promoted_and_held(r)  # a promotion, after cascades into storage
    r.mgr.prepare_store([key(i) for i in range(40, 46)], a)  # larger than CPU's room: its head
    names = {}
    for st in r.mgr.get_stats().walk():
        for n in st.counters:
            names[n] = "counter"
        for n in st.gauges:
            names[n] = "gauge"
    assert {"promoted_blocks", "cascaded_blocks", "partial_stores"} <= names.keys()
    undeclared = [n for n, kind in names.items() if n not in (COUNTERS if kind == "counter" else GAUGES)]
    assert not undeclared


def _promoted_and_held(r):
    """A request for which key 0, in storage only, was promoted into CPU."""
    r.in_storage_only(r.request("w"), [key(0)], [key(i) for i in range(20, 24)])
    a = r.request("a")
    assert r.mgr.lookup(key(0), a) is PENDING
    r.settle()
    return a


def test_a_malformed_store_raises_before_it_drops_the_holds(rig):
    """Raise first: a store with a bad key changes nothing, its request's
    holds included."""
    r = rig(cpu_chunks=4)
    a = _promoted_and_held(r)
    with pytest.raises(TypeError, match="offload keys are bytes"):
        r.mgr.prepare_store([key(30), "not-a-key"], a)
    assert r.cpu.get_stats().gauges["pinned_blocks"] == 1
    assert r.mgr.promotions.holding == 1
    r.mgr.on_request_finished(a)
    assert r.cpu.get_stats().gauges["pinned_blocks"] == 0


def test_a_request_that_computes_instead_drops_its_holds(rig):
    """vLLM loads before it computes: a request storing (its lookups ended
    at a miss elsewhere, or it gave up waiting) will never load what was
    promoted for it, so the hold must not keep CPU from others until it
    finishes."""
    r = rig(cpu_chunks=4)
    a = _promoted_and_held(r)
    assert r.cpu.get_stats().gauges["pinned_blocks"] == 1
    r.gpu_store([key(30)], a)  # computing
    r.settle()  # (its cascade to storage pinned key 30 until it landed)
    assert r.cpu.get_stats().gauges["pinned_blocks"] == 0
    assert r.mgr.lookup(key(0), a) is HIT  # still there, just evictable


def test_a_reset_releases_the_holds_before_fencing_what_is_pinned(rig):
    r = rig(cpu_chunks=4)
    a = _promoted_and_held(r)
    r.mgr.reset_cache()  # the hold is ours, read by no engine job: released, not fenced
    assert r.cpu.get_stats().gauges["fenced_blocks"] == 0
    r.mgr.on_request_finished(a)
    assert r.cpu.get_stats().gauges["pinned_blocks"] == 0


# ---- vLLM's call order: finishing before completions, resets ----------------


def _spy(manager, calls: list):
    """Record the calls a child manager gets (and still run them)."""
    for name in ("prepare_store", "prepare_load", "on_request_finished"):
        real = getattr(manager, name)

        def wrapped(*a, _real=real, _name=name, **kw):
            ctx = a[-1] if a else kw.get("req_context")
            calls.append((_name, getattr(ctx, "req_id", None)))
            return _real(*a, **kw)

        setattr(manager, name, wrapped)


def test_a_store_completing_after_the_request_finished_still_cascades_then_finishes_it(rig):
    """vLLM finishes a request in the step it submits its last store and
    completes the store later: the child hears on_request_finished once,
    after the cascade's prepare_store, and nothing is left per request."""
    r = rig(cpu_chunks=8)  # both keys in one cascade (at most a quarter of CPU in flight)
    calls = []
    _spy(r.tier.manager, calls)
    ctx = r.request("a")
    out = r.mgr.prepare_store([key(0), key(1)], ctx)
    r.mgr.on_request_finished(ctx)
    assert calls == []  # held back: the completion below will cascade
    r.mgr.complete_store(out.keys_to_store, ctx)
    assert calls == [("prepare_store", "a")]
    r.settle()  # the cascade lands: no child call can come any more
    assert calls == [("prepare_store", "a"), ("on_request_finished", "a")]
    assert not r.mgr.num_tracked_requests() and not r.mgr.has_pending_work()
    assert r.cpu.get_stats().gauges["pinned_blocks"] == 0
    r.mgr.on_request_finished(ctx)  # told twice: still once for the child
    assert [c for c in calls if c[0] == "on_request_finished"] == [("on_request_finished", "a")]


def test_a_refused_store_is_not_an_offer(rig):
    r = rig(cpu_chunks=1, store_threshold=2)
    ctx = r.request()
    first = r.mgr.prepare_store([key(0)], ctx)  # pending: the only slot
    assert r.mgr.prepare_store([key(1)], ctx) is None
    assert r.mgr.prepare_store([key(1)], ctx) is None
    r.mgr.complete_store(first.keys_to_store, ctx)
    r.settle()
    r.gpu_store([key(1)], ctx)  # its first accepted offer: below the threshold
    r.settle()
    assert r.tier.manager.lookup(key(1), ctx) is MISS


def test_reset_drops_engine_jobs_and_fences_their_slots_until_flushed(rig):
    r = rig(cpu_chunks=4)
    calls = []
    _spy(r.tier.manager, calls)
    a = r.request("a")
    r.gpu_store([key(0)], a)
    r.settle()  # key 0 in CPU and storage
    b = r.request("b")
    pending = r.mgr.prepare_store([key(1)], b)  # engine store in flight at the reset
    r.mgr.on_request_finished(b)
    load = r.mgr.prepare_load([key(0)], a)  # engine load in flight at the reset
    assert pending and load
    r.mgr.reset_cache()
    # b's store will never complete: b is finished now, its child told once
    assert ("on_request_finished", "b") in calls and not r.mgr.tracks("b")
    g = r.cpu.get_stats().gauges
    assert (g["pinned_blocks"], g["pending_blocks"], g["fenced_blocks"]) == (0, 0, 2)
    assert r.mgr.lookup(key(1), a) is MISS  # a dropped store is never readable
    # reset_cache also resets the storage tier here; store keys there again
    for i in (0, 2):
        r.gpu_store([key(i)], a)
        r.settle()
    r.cpu.reset_cache()  # CPU forgets them (no jobs in flight: nothing more fenced)
    assert r.tier.manager.lookup(key(0), a) is HIT
    # promotions take free slots only, never the fenced ones a late copy may still write
    assert r.mgr.lookup(key(0), a) is PENDING and r.mgr.lookup(key(2), a) is PENDING
    r.settle()
    assert r.mgr.lookup(key(0), a) is HIT and r.mgr.lookup(key(2), a) is HIT
    assert r.cpu.get_stats().gauges["fenced_blocks"] == 2
    r.mgr.on_reset_flushed()
    assert r.cpu.get_stats().gauges["fenced_blocks"] == 0 and len(r.cpu._free) == 2
    r.mgr.on_request_finished(a)
    r.settle()
    assert not r.mgr.num_tracked_requests() and not r.mgr.has_pending_work()
    assert [c for c in calls if c[0] == "on_request_finished"] == [
        ("on_request_finished", "b"), ("on_request_finished", "a")]


def test_released_fenced_slots_serve_the_engine_but_hold_promotions_until_flushed(rig):
    """vLLM 0.32 says nothing when a reset's flush is done; if every CPU slot
    was in flight at the reset, the adapter releases them for the engine's
    later jobs (its worker orders those after the flushed ones), and the
    promotions (our writes) wait for on_reset_flushed()."""
    r = rig(cpu_chunks=2)
    a = r.request("a")
    r.mgr.prepare_store([key(1), key(2)], a)  # the whole pool in flight
    r.mgr.reset_cache()
    assert r.mgr.prepare_store([key(0)], a) is None  # all fenced
    r.mgr.release_fenced_slots()
    assert r.cpu.get_stats().gauges["fenced_blocks"] == 0
    r.gpu_store([key(0)], a)  # the engine's own later job uses a freed slot
    r.settle()  # and key 0 cascades to storage
    r.cpu.reset_cache()  # CPU alone forgets key 0 (nothing in flight)
    assert r.tier.manager.lookup(key(0), a) is HIT
    assert r.mgr.lookup(key(0), a) is MISS  # no promotion into a freed slot yet
    r.mgr.on_reset_flushed()
    assert r.mgr.lookup(key(0), a) is PENDING
    r.settle()
    assert r.mgr.lookup(key(0), a) is HIT


def test_a_tier_whose_reset_fails_does_not_stop_the_reset(rig, monkeypatch):
    """The storage tier logs its own disk errors; this guards any tier (a
    plugin's) whose reset raises: nothing reaches the engine, and the reset's
    later steps (the per-request cleanup) still run."""
    r = rig(cpu_chunks=4)

    def broken():
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(r.tier.manager, "reset_cache", broken)
    b = r.request("b")
    assert r.mgr.prepare_store([key(1)], b)  # engine store in flight at the reset
    r.mgr.on_request_finished(b)
    r.mgr.reset_cache()
    assert not r.mgr.tracks("b")  # finished at the reset, as when every tier resets fine
