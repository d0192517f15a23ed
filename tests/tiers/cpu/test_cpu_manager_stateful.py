"""Hypothesis state machine: a CPUOffloadingManager against a plain model.

The model holds each key's state ("pending" or "ready") and its pins. The
same rules run for LRU and ARC, and "can this store fit?" is decided by the
model alone (free slots + ready, unpinned keys outside the store), so both
policies must agree on what full means: they may pick different victims,
never a different verdict.
"""

from collections import Counter

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvoffload.abstractions import LookupResult, ReqContext
from kvoffload.keys import make_offload_key
from kvoffload.tiers.cpu.manager import BlockStateError, CPUOffloadingManager
from kvoffload.tiers.cpu.slot_state import PENDING

CAPACITY = 5
KEYS = [make_offload_key(i.to_bytes(4, "big"), i % 2) for i in range(12)]
key_lists = st.lists(st.sampled_from(KEYS), min_size=1, max_size=4)
picks = st.integers(0, 1000)


class ManagerMachine(RuleBasedStateMachine):
    policy = "lru"

    def __init__(self):
        super().__init__()
        self.m = CPUOffloadingManager(CAPACITY, self.policy, enable_events=True)
        self.state: dict[bytes, str] = {}  # key -> "pending" | "ready"
        self.pins: Counter[bytes] = Counter()
        self.stores: list[list[bytes]] = []  # keys_to_store of stores in flight
        self.done_stores: list[list[bytes]] = []
        self.loads: list[list[bytes]] = []  # loads in flight
        self.fenced = 0  # slots of jobs dropped by a reset, until on_reset_flushed
        self.ctx = self.new_request()

    def new_request(self) -> ReqContext:
        # positions for some keys only: both prefix_order paths get exercised
        ctx = ReqContext("r")
        for i, k in enumerate(KEYS):
            if i % 3:
                ctx.set_offload_key_position(k, (len(KEYS) - i) * 16)
        return ctx

    @rule()
    def finish_request(self):
        self.m.on_request_finished(self.ctx)  # re-ranks, never adds or drops keys
        self.ctx = self.new_request()

    def snapshot(self):
        m = self.m
        return (dict(m._slot_of), list(m._state), list(m._free), len(m.policy), m._num_pinned)

    def evictable(self, exclude):
        return [k for k, s in self.state.items() if s == "ready" and not self.pins[k] and k not in exclude]

    @rule(keys=key_lists, with_ctx=st.booleans())
    def prepare_store(self, keys, with_ctx):
        new = list(dict.fromkeys(k for k in keys if k not in self.state))
        need = len(new) - (CAPACITY - len(self.state) - self.fenced)
        fits = need <= len(self.evictable(set(keys)))
        before = self.snapshot()
        out = self.m.prepare_store(keys, self.ctx if with_ctx else None)
        assert (out is not None) == fits, (keys, self.state, self.pins)
        if out is None:
            assert self.snapshot() == before
            return
        assert out.keys_to_store == new
        assert len(out.store_spec.block_ids) == len(new)
        assert len(out.evicted_keys) == max(need, 0)
        for k in out.evicted_keys:
            assert self.state[k] == "ready" and not self.pins[k] and k not in keys
            del self.state[k]
        for k in new:
            self.state[k] = "pending"
        if new:
            self.stores.append(new)

    @precondition(lambda self: self.stores)
    @rule(i=picks, success=st.booleans(), with_ctx=st.booleans())
    def complete_store(self, i, success, with_ctx):
        keys = self.stores.pop(i % len(self.stores))
        # vLLM passes a set
        self.m.complete_store(set(keys), self.ctx if with_ctx else None, success=success)
        for k in keys:
            if success:
                self.state[k] = "ready"
            else:
                del self.state[k]
        self.done_stores.append(keys)

    @precondition(lambda self: self.done_stores)
    @rule(i=picks, success=st.booleans())
    def complete_store_again(self, i, success):
        keys = self.done_stores[i % len(self.done_stores)]
        if any(self.state.get(k) == "pending" for k in keys):
            return  # re-prepared by a later store: completing it is legitimate
        before = self.snapshot()
        with pytest.raises(BlockStateError):
            self.m.complete_store(keys, None, success=success)
        assert self.snapshot() == before

    @rule(picked=st.lists(picks, min_size=1, max_size=3), with_ctx=st.booleans())
    def prepare_load(self, picked, with_ctx):
        ready = sorted(k for k, s in self.state.items() if s == "ready")
        if not ready:
            return
        keys = [ready[i % len(ready)] for i in picked]
        spec = self.m.prepare_load(keys, self.ctx if with_ctx else None)
        assert spec.block_ids.tolist() == [self.m.slot_of(k) for k in keys]
        self.pins.update(keys)
        self.loads.append(keys)

    @precondition(lambda self: self.loads)
    @rule(i=picks)
    def complete_load(self, i):
        keys = self.loads.pop(i % len(self.loads))
        self.m.complete_load(keys, None)
        self.pins.subtract(keys)

    @rule(key=st.sampled_from(KEYS))
    def bad_load_or_unload_changes_nothing(self, key):
        before = self.snapshot()
        if self.state.get(key) != "ready":
            with pytest.raises(BlockStateError):
                self.m.prepare_load([key], None)
        if not self.pins[key]:
            with pytest.raises(BlockStateError):
                self.m.complete_load([key], None)
        assert self.snapshot() == before

    @rule(keys=key_lists, with_ctx=st.booleans())
    def touch(self, keys, with_ctx):
        self.m.touch(keys, self.ctx if with_ctx else None)

    @rule()
    def reset_cache(self):
        # vLLM's contract: jobs in flight are dropped, never completed; their
        # slots stay out of use until on_reset_flushed()
        self.m.reset_cache()
        self.fenced += sum(1 for k, s in self.state.items() if s == "pending" or self.pins[k])
        self.state.clear()
        self.pins.clear()
        self.stores.clear()
        self.loads.clear()

    @rule()
    def on_reset_flushed(self):
        self.m.on_reset_flushed()
        self.fenced = 0

    @rule(key=st.sampled_from(KEYS))
    def lookup(self, key):
        expected = {None: LookupResult.MISS, "pending": LookupResult.HIT_PENDING, "ready": LookupResult.HIT}
        assert self.m.lookup(key, None) is expected[self.state.get(key)]

    @rule(keys=key_lists)
    def lookup_prefix(self, keys):
        # the one-pass prefix lookup answers and counts as lookup() key by key up to the first non-HIT
        expected = {None: LookupResult.MISS, "pending": LookupResult.HIT_PENDING, "ready": LookupResult.HIT}
        answers = [expected[self.state.get(k)] for k in keys]
        n = next((i for i, a in enumerate(answers) if a is not LookupResult.HIT), len(keys))
        end = answers[n] if n < len(keys) else None
        self.m.get_stats()  # zero the counters
        assert self.m.lookup_prefix(keys, None) == (n, end)
        c = self.m.get_stats().counters
        assert (c["hits"], c["hits_pending"], c["misses"]) == (
            n, int(end is LookupResult.HIT_PENDING), int(end is LookupResult.MISS))

    @invariant()
    def bookkeeping_matches_model(self):
        m = self.m
        assert set(m._slot_of) == set(self.state)
        assert len(m) <= CAPACITY
        slots = list(m._slot_of.values())
        assert len(set(slots)) == len(slots)
        assert sorted(slots + m._free + m._fenced) == list(range(CAPACITY))
        assert len(m._fenced) == self.fenced
        ready = {k for k, s in self.state.items() if s == "ready"}
        assert {k for k in KEYS if k in m.policy} == ready and len(m.policy) == len(ready)
        for k, s in self.state.items():
            v = m._state[m._slot_of[k]]
            assert v == (PENDING if s == "pending" else self.pins[k])
        g = m.get_stats().gauges
        assert g["pinned_blocks"] == sum(1 for k in self.state if self.pins[k])
        assert g["used_blocks"] == len(self.state) + self.fenced
        assert g["pending_blocks"] == sum(1 for s in self.state.values() if s == "pending")

    @invariant()
    def events_pair_up(self):
        # every key announced stored and not yet removed is held and readable
        for e in self.m.take_events():
            for k in e.keys:
                if e.removed:
                    assert k not in self.m or self.state.get(k) == "pending"
                else:
                    assert self.state.get(k) in ("ready", None)


class ARCMachine(ManagerMachine):
    policy = "arc"


SETTINGS = settings(max_examples=100, stateful_step_count=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
TestLRUManager = ManagerMachine.TestCase
TestLRUManager.settings = SETTINGS
TestARCManager = ARCMachine.TestCase
TestARCManager.settings = SETTINGS


@settings(max_examples=200, deadline=None)
@given(ready=st.integers(0, 6), pinned=st.integers(0, 6), pending=st.integers(0, 6),
       want=st.integers(1, 8), touches=st.lists(st.integers(0, 17), max_size=6))
def test_lru_and_arc_agree_on_full(ready, pinned, pending, want, touches):
    """Same history on both policies: the same store fits on both or on neither."""
    cap = max(1, ready + pinned + pending)
    results = []
    for policy in ("lru", "arc"):
        m = CPUOffloadingManager(cap, policy)
        ks = [make_offload_key(i.to_bytes(4, "big"), 0) for i in range(ready + pinned + pending)]
        done = ks[: ready + pinned]
        if done:
            m.prepare_store(done, None)
            m.complete_store(done, None)
        if pinned:
            m.prepare_load(ks[ready: ready + pinned], None)
        if pending:
            assert m.prepare_store(ks[ready + pinned:], None) is not None
        m.touch([ks[i] for i in touches if i < len(ks)], None)
        fresh = [make_offload_key(i.to_bytes(4, "big"), 1) for i in range(want)]
        out = m.prepare_store(fresh, None)
        results.append(None if out is None else len(out.evicted_keys))
    free = cap - ready - pinned - pending
    expected = None if want > free + ready else max(0, want - free)
    assert results == [expected, expected]
