"""Hypothesis state machine: the CPU manager with the `hubchain` policy.

`hubchain` may store only a head of a store's new keys (its admission), so the
verdicts differ from LRU's; the manager contract must hold all the same:
- pinned keys (loads in flight) and keys being written are never evicted;
- a store evicts none of the keys it names, nor any key of its own request
  (the prefix it just read);
- what is stored is a head of the new keys, in prefix order; once a
  request's store was cut, its later stores store nothing (a block after a
  hole is useless);
- a refused store (None) changes nothing;
- the manager's slots, the policy's keys and the gauges match a plain model.
"""

from collections import Counter

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvoffload.abstractions import ReqContext
from kvoffload.keys import make_offload_key
from kvoffload.policies.hubchain.policy import HubChainPolicy
from kvoffload.tiers.cpu.manager import CPUOffloadingManager
from kvoffload.tiers.cpu.slot_state import PENDING

CAPACITY = 5
KEYS = [make_offload_key(i.to_bytes(4, "big"), 0) for i in range(12)]
picks = st.integers(0, 1000)


class HubChainMachine(RuleBasedStateMachine):
    policy = "hubchain"
    holds_loaded_heads = True  # a running request's loaded keys are kept from other requests' stores

    def __init__(self):
        super().__init__()
        self.m = CPUOffloadingManager(CAPACITY, self.policy)
        self.state: dict[bytes, str] = {}  # key -> "pending" | "ready"
        self.pins: Counter[bytes] = Counter()
        self.stores: list[list[bytes]] = []
        self.loads: list[list[bytes]] = []
        self.ctx, self.own, self.cut = None, [], False
        self.held: set[bytes] = set()
        self.new_request(0, 4)

    @rule(start=st.integers(0, 11), length=st.integers(1, 12))
    def new_request(self, start, length):
        """A request reads KEYS[start:start+length] (its prefix, in order)."""
        self.begin(KEYS[start:start + length])

    def begin(self, own):
        if self.ctx is not None:
            self.m.on_request_finished(self.ctx)
        self.ctx = ReqContext(f"r{KEYS.index(own[0])}-{len(own)}")
        self.own = own
        for i, k in enumerate(self.own):
            self.ctx.set_offload_key_position(k, (i + 1) * 16)
        self.cut = False
        self.held = set()  # the finished request let go of its head
        self.m.on_new_request(self.ctx)

    def snapshot(self):
        m = self.m
        return (dict(m._slot_of), list(m._state), list(m._free), len(m.policy), m._num_pinned)

    @rule(a=picks, b=picks)
    def prepare_store(self, a, b):
        """Stores continue the request's prefix (a slice of it, head first)."""
        lo = a % len(self.own)
        keys = self.own[lo:lo + 1 + b % 4]
        new = [k for k in keys if k not in self.state]
        before = self.snapshot()
        out = self.m.prepare_store(keys, self.ctx)
        if out is None:
            assert self.snapshot() == before
            return
        stored = out.keys_to_store
        assert stored == new[:len(stored)], "stored keys are not a head of the new keys"
        if self.cut:
            assert not stored, "a request stored more after its store was cut"
        if len(stored) < len(new):
            self.cut = True
        for k in out.evicted_keys:
            assert self.state[k] == "ready" and not self.pins[k], "evicted a pinned or pending key"
            assert k not in keys and k not in self.own, "evicted a key of its own request"
            del self.state[k]
        for k in stored:
            self.state[k] = "pending"
        if stored:
            self.stores.append(stored)

    @precondition(lambda self: self.stores)
    @rule(i=picks, success=st.booleans())
    def complete_store(self, i, success):
        keys = self.stores.pop(i % len(self.stores))
        self.m.complete_store(set(keys), self.ctx, success=success)
        for k in keys:
            if success:
                self.state[k] = "ready"
            else:
                del self.state[k]

    @rule(n=st.integers(1, 12))
    def load_prefix(self, n):
        """Load the request's leading run of ready keys (as the scheduler does)."""
        run = []
        for k in self.own[:n]:
            if self.state.get(k) != "ready":
                break
            run.append(k)
        if run:
            self.m.prepare_load(run, self.ctx)
            if self.holds_loaded_heads:
                self.held.update(run)
            self.pins.update(run)
            self.loads.append(run)

    @precondition(lambda self: self.loads)
    @rule(i=picks)
    def complete_load(self, i):
        keys = self.loads.pop(i % len(self.loads))
        self.m.complete_load(keys, self.ctx)
        self.pins.subtract(keys)

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4))
    def store_without_context(self, keys):
        """No context: no structure known, so no admission (plain LRU)."""
        new = list(dict.fromkeys(k for k in keys if k not in self.state))
        evictable = [k for k, s in self.state.items()
                     if s == "ready" and not self.pins[k] and k not in keys and k not in self.held]
        fits = len(new) - (CAPACITY - len(self.state)) <= len(evictable)
        before = self.snapshot()
        out = self.m.prepare_store(keys, None)
        assert (out is not None) == fits
        if out is None:
            assert self.snapshot() == before
            return
        assert out.keys_to_store == new
        for k in out.evicted_keys:
            assert k in evictable
            del self.state[k]
        for k in new:
            self.state[k] = "pending"
        if new:
            self.stores.append(new)

    @rule()
    def reset_cache(self):
        if self.loads or self.stores:
            return  # the fenced-slot rules are the generic machine's (test_cpu_manager_stateful)
        self.m.reset_cache()  # a fresh policy: the request's cut is forgotten with the rest
        self.state.clear()
        self.held = set()
        self.cut = False

    @invariant()
    def bookkeeping_matches_model(self):
        m = self.m
        assert set(m._slot_of) == set(self.state)
        slots = list(m._slot_of.values())
        assert len(set(slots)) == len(slots)
        assert sorted(slots + m._free + m._fenced) == list(range(CAPACITY))
        ready = {k for k, s in self.state.items() if s == "ready"}
        assert {k for k in KEYS if k in m.policy} == ready and len(m.policy) == len(ready)
        for k, s in self.state.items():
            assert m._state[m._slot_of[k]] == (PENDING if s == "pending" else self.pins[k])
        g = m.get_stats().gauges
        assert g["pinned_blocks"] == sum(1 for k in self.state if self.pins[k])
        assert g["used_blocks"] == len(self.state)

    @invariant()
    def sampled_episodes_are_counted_by_rate(self):
        pol = self.m.policy
        live = [0] * len(pol._live)
        for e in pol._episodes.values():
            live[(e >> 1) & 127] += 1
        assert live == pol._live
        assert pol._low <= min(pol._rate) and all(n == 0 for n in live[:pol._low])

    @invariant()
    def arc_ghosts_are_bounded_and_not_resident(self):
        pol, cap = self.m.policy, self.m.policy.capacity
        assert len(pol._b1) <= cap and len(pol._b1) + len(pol._b2) <= 2 * cap
        assert pol._b1.keys().isdisjoint(pol._b2) and 0.0 <= pol._p <= cap
        assert not any(k in pol for k in pol._b1) and not any(k in pol for k in pol._b2)

    @invariant()
    def hub_ghosts_are_bounded_apart_and_not_resident(self):
        pol, cap = self.m.policy, self.m.policy.capacity
        assert len(pol._hub_ghosts) <= cap and 0.0 <= pol._q <= cap
        assert pol._hub_ghosts.keys().isdisjoint(pol._b1) and pol._hub_ghosts.keys().isdisjoint(pol._b2)
        assert not any(k in pol for k in pol._hub_ghosts)


TestHubChainManager = HubChainMachine.TestCase
TestHubChainManager.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                        suppress_health_check=[HealthCheck.too_slow])


class SmallHubChainPolicy(HubChainPolicy):
    HUB = 1  # every store after a resident block is a hub branch: their ghosts and q act within a few steps

    def __init__(self, capacity):
        super().__init__(capacity)
        self._q = 1.0  # the hub branch order's oldest go first from the first eviction on


class SmallHubChainMachine(HubChainMachine):
    """`hubchain` where every branch is off a hub, so that hub branch blocks, their ghosts and q act."""
    policy = "tests.policies.test_hubchain_stateful:SmallHubChainPolicy"

    @rule(head=st.integers(1, 3), start=st.integers(4, 10), length=st.integers(1, 2))
    def new_branch_request(self, head, start, length):
        """A request that reads a shared head, then a branch of its own."""
        self.begin(KEYS[:head] + KEYS[start:start + length])


TestSmallHubChainManager = SmallHubChainMachine.TestCase
TestSmallHubChainManager.settings = settings(max_examples=150, stateful_step_count=60, deadline=None,
                                             suppress_health_check=[HealthCheck.too_slow])
