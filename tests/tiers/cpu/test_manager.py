"""CPUOffloadingManager: slots, pins, pending writes, eviction, events, stats."""

import pytest
from cpu_manager_rig import POLICIES, K, keys, snapshot, store

from kvoffload.abstractions import LookupResult, ReqContext
from kvoffload.config import ConfigError
from kvoffload.geometry import ChunkGeometry, ResolvedGeometry
from kvoffload.tiers.cpu.manager import BlockStateError, CPUOffloadingManager


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
