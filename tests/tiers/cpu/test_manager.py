"""CPUOffloadingManager: slots, pins, pending writes, eviction, events, stats."""

import pytest

from kvoffload.abstractions import LookupResult, ReqContext
from kvoffload.config import ConfigError
from kvoffload.geometry import ChunkGeometry, ResolvedGeometry
from kvoffload.keys import make_offload_key
from kvoffload.tiers.cpu.manager import BlockStateError, CPUOffloadingManager

POLICIES = ["lru", "arc"]


def K(i: int, group: int = 0) -> bytes:
    return make_offload_key(i.to_bytes(8, "big"), group)


def keys(*ids):
    return [K(i) for i in ids]


def store(m, ks, ctx=None):
    out = m.prepare_store(ks, ctx)
    assert out is not None
    m.complete_store(ks, ctx)
    return out


def snapshot(m):
    return (dict(m._slot_of), list(m._state), list(m._free), m._num_pinned, m._num_pending, len(m.policy))


@pytest.mark.parametrize("policy", POLICIES)
def test_store_makes_keys_readable_and_slots_come_from_free_list(policy):
    m = CPUOffloadingManager(4, policy)
    out = m.prepare_store(keys(1, 2, 3), None)
    assert out.keys_to_store == keys(1, 2, 3)
    assert out.store_spec.block_ids.tolist() == [0, 1, 2]
    assert out.evicted_keys == []
    assert m.lookup(K(1), None) is LookupResult.HIT_PENDING
    m.complete_store(keys(1, 2, 3), None)
    assert [m.lookup(k, None) for k in keys(1, 2, 3, 4)] == [LookupResult.HIT] * 3 + [LookupResult.MISS]
    spec = m.prepare_load(keys(3, 1), None)
    assert spec.block_ids.tolist() == [2, 0]
    m.complete_load(keys(3, 1), None)


@pytest.mark.parametrize("policy", POLICIES)
def test_prepare_store_skips_already_stored_and_never_evicts_them(policy):
    m = CPUOffloadingManager(3, policy)
    store(m, keys(1, 2, 3))
    out = m.prepare_store(keys(1, 4), None)  # 1 is the oldest, but part of this store
    assert out.keys_to_store == keys(4)
    assert K(1) not in out.evicted_keys and len(out.evicted_keys) == 1
    assert m.lookup(K(1), None) is LookupResult.HIT


@pytest.mark.parametrize("policy", POLICIES)
def test_pending_and_pinned_are_never_evicted_and_failure_changes_nothing(policy):
    m = CPUOffloadingManager(3, policy)
    store(m, keys(1, 2))
    m.prepare_load(keys(1), None)
    m.prepare_load(keys(2), None)
    assert m.prepare_store(keys(3), None) is not None  # uses the last free slot, pending
    before = snapshot(m)
    assert m.prepare_store(keys(4), None) is None
    assert snapshot(m) == before
    assert m.get_stats().counters["allocation_failures"] == 1
    m.complete_load(keys(1), None)
    out = m.prepare_store(keys(4), None)
    assert out.evicted_keys == keys(1)


@pytest.mark.parametrize("policy", POLICIES)
def test_store_larger_than_capacity_fails_cleanly(policy):
    m = CPUOffloadingManager(2, policy)
    store(m, keys(1))
    before = snapshot(m)
    assert m.prepare_store(keys(2, 3, 4), None) is None
    assert snapshot(m) == before


@pytest.mark.parametrize("policy", POLICIES)
def test_failed_store_frees_only_what_was_not_stored(policy):
    m = CPUOffloadingManager(4, policy)
    store(m, keys(1))
    out = m.prepare_store(keys(1, 2, 3), None)
    assert out.keys_to_store == keys(2, 3)
    m.complete_store(keys(1, 2, 3), None, success=False)
    assert m.lookup(K(1), None) is LookupResult.HIT
    assert m.lookup(K(2), None) is LookupResult.MISS
    assert len(m._free) == 3
    assert m.get_stats().counters["dropped_stores"] == 2


@pytest.mark.parametrize("policy", POLICIES)
def test_tail_of_a_prefix_is_evicted_before_its_head(policy):
    m = CPUOffloadingManager(4, policy)
    store(m, keys(1, 2, 3, 4))  # one request's prefix, head first
    out = m.prepare_store(keys(5, 6), None)
    assert out.evicted_keys == keys(4, 3)


@pytest.mark.parametrize("policy", POLICIES)
def test_key_positions_order_out_of_order_stores(policy):
    m = CPUOffloadingManager(4, policy)
    ctx = ReqContext("r")
    for pos, k in enumerate(keys(1, 2, 3, 4)):
        ctx.set_offload_key_position(k, (pos + 1) * 16)
    store(m, keys(3, 1, 4, 2), ctx)  # completed out of order
    out = m.prepare_store(keys(5), None)
    assert out.evicted_keys == keys(4)


@pytest.mark.parametrize("policy", POLICIES)
def test_touch_protects_recently_used(policy):
    m = CPUOffloadingManager(3, policy)
    store(m, keys(1))
    store(m, keys(2))
    store(m, keys(3))
    m.touch(keys(1), None)
    out = m.prepare_store(keys(4), None)
    assert K(1) not in out.evicted_keys


@pytest.mark.parametrize("policy", POLICIES)
def test_bad_keys_raise_type_error_and_change_nothing(policy):
    m = CPUOffloadingManager(3, policy)
    store(m, keys(1))
    before = snapshot(m)
    for bad in ["abc", (b"x", 0), 7, bytearray(b"123456789")]:
        with pytest.raises(TypeError, match="bytes"):
            m.prepare_store([K(2), bad], None)
        with pytest.raises(TypeError):
            m.lookup(bad, None)
        with pytest.raises(TypeError):
            m.prepare_load([K(1), bad], None)
    with pytest.raises(ValueError, match="short"):
        m.prepare_store([K(2), b"ab"], None)
    assert snapshot(m) == before


@pytest.mark.parametrize("policy", POLICIES)
def test_load_of_missing_or_pending_key_raises_and_changes_nothing(policy):
    m = CPUOffloadingManager(3, policy)
    store(m, keys(1))
    m.prepare_store(keys(2), None)
    before = snapshot(m)
    with pytest.raises(BlockStateError, match="not stored"):
        m.prepare_load(keys(1, 9), None)
    with pytest.raises(KeyError, match="being written"):
        m.prepare_load(keys(1, 2), None)
    assert snapshot(m) == before


@pytest.mark.parametrize("policy", POLICIES)
def test_double_complete_raises_and_changes_nothing(policy):
    m = CPUOffloadingManager(3, policy)
    store(m, keys(1, 2))
    before = snapshot(m)
    with pytest.raises(BlockStateError, match="no store in flight"):
        m.complete_store(keys(1, 2), None)
    with pytest.raises(BlockStateError, match="never prepared"):
        m.complete_store(keys(7), None, success=False)
    assert snapshot(m) == before
    m.prepare_load(keys(1), None)
    m.complete_load(keys(1), None)
    before = snapshot(m)
    with pytest.raises(BlockStateError, match="no load in flight"):
        m.complete_load(keys(1), None)
    m.prepare_load(keys(1), None)
    mid = snapshot(m)
    with pytest.raises(BlockStateError, match="more often than"):
        m.complete_load(keys(1, 1), None)
    assert snapshot(m) == mid
    m.complete_load(keys(1), None)
    assert snapshot(m) == before
    out = m.prepare_store(keys(3), None)
    m.complete_store(keys(3), None, success=False)
    with pytest.raises(BlockStateError):
        m.complete_store(keys(3), None, success=False)
    assert out is not None


def test_pins_are_counted():
    m = CPUOffloadingManager(3)
    store(m, keys(1, 2))
    m.prepare_load(keys(1, 1, 2), None)
    assert m.get_stats().gauges["pinned_blocks"] == 2
    m.complete_load(keys(1, 2), None)
    assert m.get_stats().gauges["pinned_blocks"] == 1
    m.complete_load(keys(1), None)
    assert m.get_stats().gauges["pinned_blocks"] == 0


def test_events_only_when_enabled():
    m = CPUOffloadingManager(2, enable_events=False)
    store(m, keys(1, 2))
    store(m, keys(3))
    assert list(m.take_events()) == []
    m = CPUOffloadingManager(2, enable_events=True)
    store(m, keys(1, 2))
    m.prepare_store(keys(4), None)
    m.complete_store(keys(4), None, success=False)  # never announced: a metadata-only cleanup
    store(m, keys(3))
    ev = list(m.take_events())
    assert [(e.keys, e.removed, e.metadata_only) for e in ev] == [
        (keys(1, 2), False, False), (keys(2), True, False), (keys(4), True, True), (keys(3), False, False)]
    assert list(m.take_events()) == []
    m.reset_cache()
    ev = list(m.take_events())
    assert len(ev) == 1 and ev[0].removed and sorted(ev[0].keys) == sorted(keys(1, 3))


@pytest.mark.parametrize("policy", POLICIES)
def test_reset_drops_jobs_in_flight_and_fences_their_slots_until_flushed(policy):
    """vLLM's contract: jobs in flight at a reset are never completed, and
    on_reset_flushed() says when the workers are done with their slots."""
    m = CPUOffloadingManager(4, policy)
    store(m, keys(1, 2))
    m.prepare_load(keys(1), None)
    m.prepare_store(keys(3), None)
    m.reset_cache()
    # nothing readable or pending: a dropped store's bytes may never land
    assert [m.lookup(k, None) for k in keys(1, 2, 3)] == [LookupResult.MISS] * 3
    g = m.get_stats().gauges
    assert (g["pinned_blocks"], g["pending_blocks"], g["fenced_blocks"]) == (0, 0, 2)
    assert len(m.policy) == 0 and len(m) == 0
    # the fenced slots (a worker may still use them) are not handed out
    out = m.prepare_store(keys(4, 5, 6), None)
    assert out is None
    out = m.prepare_store(keys(4, 5), None)
    fenced = set(range(4)) - set(out.store_spec.block_ids.tolist()) - set(m._free)
    assert len(fenced) == 2
    with pytest.raises(BlockStateError):  # the dropped jobs' completions are refused
        m.complete_load(keys(1), None)
    m.on_reset_flushed()
    assert m.get_stats().gauges["fenced_blocks"] == 0 and sorted(m._free) == sorted(fenced)
    m.complete_store(keys(4, 5), None)
    assert m.prepare_store(keys(6, 7), None) is not None  # the freed slots serve new stores


def test_resets_before_a_flush_fence_cumulatively():
    m = CPUOffloadingManager(3)
    m.prepare_store(keys(1), None)
    m.reset_cache()
    m.prepare_store(keys(2), None)
    m.reset_cache()  # vLLM flushes both resets' jobs before its one on_reset_flushed()
    assert m.get_stats().gauges["fenced_blocks"] == 2 and len(m._free) == 1
    m.on_reset_flushed()
    assert len(m._free) == 3 and m.lookup(K(1), None) is LookupResult.MISS


def test_stats_are_deltas_and_gauges_current():
    resolved = ResolvedGeometry()
    m = CPUOffloadingManager(4, geometry=resolved)
    assert m.chunk_bytes == 0  # unknown yet: byte counters count 0
    resolved.geometry = ChunkGeometry(tokens_per_chunk=16, chunk_bytes=100, num_chunks=4)
    store(m, keys(1, 2))
    m.lookup(K(1), None)
    m.lookup(K(9), None)
    m.prepare_load(keys(1), None)
    m.complete_load(keys(1), None)
    s = m.get_stats()
    assert s.tier == "cpu"
    c = s.counters
    assert (c["lookups"], c["hits"], c["misses"], c["stored_blocks"], c["stored_bytes"]) == (2, 1, 1, 2, 200)
    assert (c["loaded_blocks"], c["loaded_bytes"]) == (1, 100)
    assert s.gauges["used_blocks"] == 2 and s.gauges["usage"] == 0.5 and s.gauges["capacity_blocks"] == 4
    assert all(v == 0 for v in m.get_stats().counters.values())


@pytest.mark.parametrize("bad", [0, -3, 1.5, True, "8"])
def test_bad_capacity_raises(bad):
    with pytest.raises(ConfigError, match="num_chunks"):
        CPUOffloadingManager(bad)


def test_unknown_policy_raises_naming_it():
    with pytest.raises(ConfigError, match="'fifo'.*lru"):
        CPUOffloadingManager(4, "fifo")


def test_duplicate_keys_in_one_store_get_one_slot():
    m = CPUOffloadingManager(4)
    out = m.prepare_store(keys(1, 1, 2), None)
    assert out.keys_to_store == keys(1, 2)
    m.complete_store(keys(1, 1, 2), None)
    assert len(m._free) == 2 and len(m.policy) == 2


@pytest.mark.parametrize("policy", POLICIES)
def test_bad_keys_in_touch_and_completes_raise_type_error(policy):
    m = CPUOffloadingManager(3, policy)
    store(m, keys(1))
    m.prepare_load(keys(1), None)
    m.prepare_store(keys(2), None)
    before = snapshot(m)
    for bad in ["abc", [1], 7]:
        for call in (m.touch, m.complete_load, m.complete_store):
            with pytest.raises(TypeError, match="offload keys are bytes"):
                call([K(1), bad], None)
    assert snapshot(m) == before


def test_complete_store_accepts_a_set_and_orders_by_position():
    m = CPUOffloadingManager(4)
    ctx = ReqContext("r")
    ks = keys(1, 2, 3, 4)
    for pos, k in enumerate(ks):
        ctx.set_offload_key_position(k, pos)
    out = m.prepare_store(ks, ctx)
    m.complete_store(set(out.keys_to_store), ctx)
    assert m.prepare_store(keys(5, 6, 7), None).evicted_keys == keys(4, 3, 2)


def test_reset_cache_drops_arc_history():
    m = CPUOffloadingManager(4, "arc")
    store(m, keys(1, 2, 3, 4))
    m.touch(keys(1, 2), None)  # T2
    store(m, keys(5, 6))  # 4 and 3 leave T1 and become ghosts
    store(m, keys(3))  # a ghost hit: p grows
    assert m.policy.b1 and m.policy.p > 0
    m.prepare_load(keys(5), None)
    m.reset_cache()
    assert not m.policy.b1 and not m.policy.b2 and m.policy.p == 0
    assert len(m.policy) == 0  # the pinned key is dropped too; its slot is fenced
    m.on_reset_flushed()
    assert m.prepare_store(keys(7, 8, 9, 10), None).evicted_keys == []


def _req(name, ks):
    ctx = ReqContext(name)
    for pos, k in enumerate(ks):
        ctx.set_offload_key_position(k, (pos + 1) * 16)
    return ctx


@pytest.mark.parametrize("policy", POLICIES)
def test_request_stored_in_batches_loses_its_tail_first(policy):
    m = CPUOffloadingManager(6, policy)
    ks = keys(1, 2, 3, 4, 5, 6)
    ctx = _req("a", ks)
    m.on_new_request(ctx)
    for batch in (ks[:2], ks[2:4], ks[4:]):  # head first, as a prefill proceeds
        out = m.prepare_store(batch, ctx)
        m.complete_store(set(out.keys_to_store), ctx)
    m.on_request_finished(ctx)
    assert m.prepare_store(keys(7, 8, 9), None).evicted_keys == keys(6, 5, 4)


@pytest.mark.parametrize("policy", POLICIES)
def test_finished_request_commits_reuse_of_loaded_keys(policy):
    m = CPUOffloadingManager(4, policy)
    store(m, keys(1, 2))  # an older request's prefix
    store(m, keys(3, 4))  # a newer, unrelated one
    ctx = _req("b", keys(1, 2))
    m.on_new_request(ctx)
    m.prepare_load(keys(1, 2), ctx)
    m.complete_load(keys(1, 2), ctx)
    m.on_request_finished(ctx)  # 1, 2 reused: now the most recent
    assert m.prepare_store(keys(5, 6), None).evicted_keys == keys(4, 3)


def test_arc_finish_does_not_count_a_store_as_a_use():
    m = CPUOffloadingManager(8, "arc")
    ctx = _req("a", keys(1, 2, 3))
    m.prepare_load([], ctx)
    m.prepare_store(keys(1, 2, 3), ctx)
    m.complete_store(keys(1, 2, 3), ctx)
    m.on_request_finished(ctx)
    assert list(m.policy.t2) == [] and set(m.policy.t1) == set(keys(1, 2, 3))
    ctx = _req("b", keys(1, 2))
    m.prepare_load(keys(1, 2), ctx)
    m.complete_load(keys(1, 2), ctx)
    m.on_request_finished(ctx)
    assert list(m.policy.t2) == keys(2, 1)  # reused: promoted, head most recent


def test_late_completion_after_finish_and_shared_contexts():
    a, b = CPUOffloadingManager(4), CPUOffloadingManager(4, "arc")
    ctx = _req("a", keys(1, 2))
    for m in (a, b):
        m.prepare_store(keys(1, 2), ctx)
    for m in (a, b):
        m.on_request_finished(ctx)
        m.complete_store(keys(1, 2), ctx)  # a completion may arrive after the finish
        m.on_request_finished(ctx)  # twice is harmless
        assert m.lookup(K(1), ctx) is LookupResult.HIT and len(m.policy) == 2


def test_a_store_landing_after_the_finish_keeps_nothing_of_its_request():
    """vLLM finishes a request in the step it submits its last store, which
    completes after. When no store of the request had landed before its
    finish, LRU opened a live group at that completion, and the group kept
    the request's key positions (its whole context) alive until every key
    it stored was evicted: about 110 entries per resident block here."""
    import gc
    import tracemalloc

    m = CPUOffloadingManager(256)
    shared = [K(i) for i in range(500)]  # a long context, stored once
    store(m, shared[:200], None)
    tracemalloc.start()
    try:
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        for r in range(200):
            ctx = _req(f"r{r}", shared + [K(10_000 + r)])
            out = m.prepare_store([K(10_000 + r)], ctx)  # its only store, submitted in its last step
            m.on_request_finished(ctx)
            m.complete_store(out.keys_to_store, ctx)  # lands after the finish
            del ctx
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert m.lookup(K(10_199), ReqContext("x")) is LookupResult.HIT
    assert kept < 1_000_000  # the 200 requests' positions alone take several MB


def test_reading_back_own_stores_is_not_a_reuse():
    m = CPUOffloadingManager(8, "arc")
    ctx = _req("a", keys(1, 2))
    out = m.prepare_store(keys(1, 2), ctx)
    m.complete_store(out.keys_to_store, ctx)
    m.prepare_load(keys(1, 2), ctx)  # e.g. a cascade copying them to a lower tier
    m.complete_load(keys(1, 2), ctx)
    m.on_request_finished(ctx)
    assert not m.policy.t2


def _store_batches(m, ctx, *batches):
    for b in batches:
        out = m.prepare_store(b, ctx)
        m.complete_store(set(out.keys_to_store), ctx)  # vLLM passes a set


def _evict_one_by_one(m, n):
    order = []
    for j in range(n):
        out = m.prepare_store([K(1000 + j)], None)
        m.complete_store(out.keys_to_store, None)
        order += out.evicted_keys
    return order


@pytest.mark.parametrize("policy", ["lru"])  # vLLM's ARC appends to T1 as stored, as ours
def test_a_running_request_keeps_prefix_order_across_its_batches(policy):
    """vLLM 0.33's LRU order: while a request runs, its stores rank
    together, tail first, however many batches they came in (its head
    outlives its tail, so what it stored stays reachable)."""
    m = CPUOffloadingManager(6, policy)
    old = _req("old", keys(100, 101))
    _store_batches(m, old, keys(100, 101))
    m.on_request_finished(old)
    r = _req("r", keys(0, 1, 2, 3))
    _store_batches(m, r, keys(0, 1), keys(2, 3))  # still running
    assert _evict_one_by_one(m, 6) == keys(101, 100, 3, 2, 1, 0)


@pytest.mark.parametrize("policy", ["lru"])
def test_a_running_request_ranks_at_its_first_store(policy):
    m = CPUOffloadingManager(4, policy)
    a = _req("a", keys(1, 2))
    _store_batches(m, a, keys(1))
    b = _req("b", keys(9))
    _store_batches(m, b, keys(9))
    m.on_request_finished(b)
    _store_batches(m, a, keys(2))  # a's tail, stored after b finished
    assert _evict_one_by_one(m, 4)[:3] == keys(2, 1, 9)
    m.on_request_finished(a)


@pytest.mark.parametrize("policy", ["lru"])
def test_finishing_reranks_a_requests_batches_head_most_recent(policy):
    m = CPUOffloadingManager(6, policy)
    r = _req("r", keys(0, 1, 2, 3))
    _store_batches(m, r, keys(0, 1), keys(2, 3))
    other = _req("o", keys(7))
    _store_batches(m, other, keys(7))
    m.on_request_finished(other)
    m.on_request_finished(r)  # now the most recent, head last out
    assert _evict_one_by_one(m, 6)[:5] == keys(7, 3, 2, 1, 0)


@pytest.mark.parametrize("policy", ["lru"])
@pytest.mark.parametrize("order", [(0, 2, 1), (2, 1, 0)])  # a backfill; batches completed in reverse
def test_a_running_request_loses_its_tail_first_whatever_order_its_batches_came_in(policy, order):
    m = CPUOffloadingManager(6, policy)
    r = _req("r", keys(0, 1, 2))
    outs = [m.prepare_store([K(i)], r) for i in order]
    for out in reversed(outs) if order == (2, 1, 0) else outs:
        m.complete_store(set(out.keys_to_store), r)
    assert _evict_one_by_one(m, 6)[:3] == keys(2, 1, 0)


@pytest.mark.parametrize("policy", ["lru"])
def test_a_running_request_keeps_the_prefix_it_loaded_over_its_new_tail(policy):
    """vLLM 0.33: a request's reads rank with its own keys while it runs, so
    under pressure it loses its new tail before the reused head it needs."""
    m = CPUOffloadingManager(4, policy)
    seed = _req("seed", keys(1, 2))
    _store_batches(m, seed, keys(1, 2))
    m.on_request_finished(seed)
    r = _req("r", keys(1, 2, 3))
    m.prepare_load(keys(1, 2), r)
    m.complete_load({K(1), K(2)}, r)
    _store_batches(m, r, keys(3))
    assert _evict_one_by_one(m, 3) == keys(3, 2)  # one slot was free
    assert m.lookup(K(1), r) is LookupResult.HIT


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("finish_first", [False, True])
def test_without_key_positions_a_request_ranks_in_its_prepare_store_order(policy, finish_first):
    """complete_store gets a set (vLLM's): with no end-token positions on the
    context, the order the request prepared its stores in is its prefix."""
    m = CPUOffloadingManager(6, policy)
    r = ReqContext("r")
    ks = keys(5, 3, 9, 1, 7, 2)  # prefix order, not sorted by value
    out = m.prepare_store(ks, r)
    if finish_first:
        m.on_request_finished(r)
    m.complete_store(set(out.keys_to_store), r)
    if not finish_first:
        m.on_request_finished(r)
    assert _evict_one_by_one(m, 6) == ks[::-1]


@pytest.mark.parametrize("bad", [[1, 2], "not bytes", None], ids=["unhashable", "str", "none"])
def test_lookup_prefix_refuses_a_bad_key_as_lookup_does(bad):
    m = CPUOffloadingManager(4)
    good = make_offload_key(b"a", 0)
    m.prepare_store([good], None)
    m.complete_store([good], None)
    with pytest.raises(Exception) as one:
        m.lookup(bad, None)
    m.get_stats()
    with pytest.raises(one.type):
        m.lookup_prefix([good, bad], None)
    assert m.get_stats().counters["lookups"] == 0  # a call that raises counts nothing


def test_a_store_landing_after_the_request_finished_keeps_nothing_of_the_request():
    # vLLM finishes a request in the step it submits its last store; the store completes
    # later. The LRU must not open a running-request group for it: that group (and the
    # request's key positions it holds) would live as long as its keys.
    from kvoffload.policies.lru import _Group
    m = CPUOffloadingManager(8, "lru")
    ctx = ReqContext("r")
    for pos, k in enumerate(keys(1, 2, 3, 4)):
        ctx.set_offload_key_position(k, (pos + 1) * 16)
    m.prepare_store(keys(1, 2), ctx)
    m.complete_store(keys(1, 2), ctx)
    m.prepare_store(keys(3, 4), ctx)
    m.on_request_finished(ctx)
    m.complete_store(keys(3, 4), ctx)
    groups = [g for g in m.policy._order.values() if isinstance(g, _Group)]
    assert not any(g.live or g.positions for g in groups)
    # ranked as loose keys, newer than the batch re-ranked at the finish, each batch tail first
    assert m.prepare_store(keys(5, 6, 7, 8, 9, 10, 11), None).evicted_keys == keys(2, 1, 4)


@pytest.mark.parametrize("policy", ["lru", "arc", "hubchain"])
def test_a_pool_fenced_by_a_reset_is_no_room_and_the_same_store_offered_again_lands(policy):
    """A reset while every slot is being written: the slots stay fenced until
    on_reset_flushed. A store meanwhile is None for every policy (vLLM offers
    the same blocks again next step). A prefix policy's admission is not
    asked: it would cut the request's store for good, and an empty answer
    makes vLLM move past those blocks, so they were never stored (found by
    vLLM's own types)."""
    m = CPUOffloadingManager(2, policy)
    m.prepare_store(keys(1, 2), None)  # both in flight at the reset
    m.reset_cache()
    ctx = ReqContext("r")
    ctx.set_offload_key_positions(keys(3, 4), [16, 32])
    m.on_new_request(ctx)
    before = snapshot(m)
    assert m.prepare_store(keys(3, 4), ctx) is None
    assert snapshot(m) == before
    m.on_reset_flushed()
    out = m.prepare_store(keys(3, 4), ctx)  # the same store again, now with room
    assert out is not None and out.keys_to_store == keys(3, 4) and not out.evicted_keys
