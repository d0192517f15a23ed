"""Hypothesis: every registered policy keeps the policy contract under any
sequence of calls, alone and inside the CPU manager.

- len / contains match a plain model of the held keys;
- evict(n) returns n distinct held keys with can_evict True and drops them;
- a refused evict (None) leaves the policy's whole state unchanged;
- pinned keys (can_evict False) are never returned;
- in the manager, a key being loaded is never evicted.
"""

import hypothesis.strategies as st
import pytest
from atomicity import deep_state
from hypothesis import HealthCheck, given, settings

from kvoffload.abstractions import ReqContext
from kvoffload.policies import BUILT_IN, get_policy_class
from kvoffload.tiers.cpu.manager import CPUOffloadingManager

BUILT = sorted(BUILT_IN)
KEYS = [i.to_bytes(8, "big") + b"\0\0\0\0" for i in range(16)]

op = st.one_of(
    st.tuples(st.just("insert"), st.lists(st.sampled_from(KEYS), min_size=1, max_size=5, unique=True)),
    st.tuples(st.just("touch"), st.lists(st.sampled_from(KEYS), min_size=1, max_size=5, unique=True)),
    st.tuples(st.just("remove"), st.sampled_from(KEYS)),
    st.tuples(st.just("evict"), st.integers(0, 8), st.sets(st.sampled_from(KEYS), max_size=16)),
    st.tuples(st.just("request"), st.just(None)),
)


@pytest.mark.parametrize("policy", BUILT)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, max_size=60), capacity=st.integers(1, 10))
def test_policy_contract(policy, ops, capacity):
    pol = get_policy_class(policy)(capacity)
    held: set[bytes] = set()
    ctx = ReqContext("r0")
    for i, (name, *args) in enumerate(ops):
        if name == "request":
            ctx = ReqContext(f"r{i}")
        elif name == "insert":
            new = [k for k in args[0] if k not in held]
            room = capacity - len(held)
            new = new[:max(room, 0)]  # the manager never over-fills a policy
            if new:
                pol.insert(new, ctx)
                held.update(new)
        elif name == "touch":
            pol.touch(args[0], ctx)  # unknown keys are ignored
        elif name == "remove":
            pol.remove(args[0])
            held.discard(args[0])
        else:
            n, pinned = args
            before = deep_state(pol)  # by value, nested state too
            out = pol.evict(n, lambda k: k not in pinned)
            if out is None:
                assert len(held - pinned) < n, "refused although enough keys were evictable"
                assert deep_state(pol) == before, "a refused evict changed the policy"
            else:
                assert len(out) == n == len(set(out))
                assert set(out) <= held - pinned
                held -= set(out)
        assert len(pol) == len(held)
        for k in KEYS:
            assert (k in pol) == (k in held)


@pytest.mark.parametrize("policy", BUILT)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=st.lists(st.lists(st.sampled_from(KEYS), min_size=1, max_size=6, unique=True), max_size=30))
def test_manager_never_evicts_a_key_being_loaded(policy, reqs):
    m = CPUOffloadingManager(6, policy)
    loading: list[bytes] = []
    for i, keys in enumerate(reqs):
        ctx = ReqContext(f"r{i}")
        held = [k for k in keys if k in m]
        if held:
            m.prepare_load(held, ctx)
            m.touch(keys, ctx)
        out = m.prepare_store(keys, ctx)
        if out is not None:
            assert not set(out.evicted_keys) & set(held + loading)
            m.complete_store(out.keys_to_store, ctx)
        if i % 2 == 0 and loading:
            m.complete_load(loading, ctx)
            loading = []
        if held:
            if i % 2:
                m.complete_load(held, ctx)
            else:
                loading += held
        for k in loading:
            assert k in m
