"""CPUOffloadingManager and requests: the eviction order of what a request
stored and read (prefix tail first, running requests ranked together, late
completions after the finish), and stores offered while a reset fences the pool."""

import pytest
from cpu_manager_rig import POLICIES, K, keys, snapshot, store

from kvoffload.abstractions import LookupResult, ReqContext
from kvoffload.keys import make_offload_key
from kvoffload.tiers.cpu.manager import CPUOffloadingManager


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
