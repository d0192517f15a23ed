"""The `duel` policy: segchain or ARC, chosen by two miniature shadow caches."""

import hypothesis.strategies as st
import pytest
from atomicity import deep_state
from hypothesis import HealthCheck, given, settings

from kvoffload.abstractions import ReqContext
from kvoffload.policies.duel import ARC, SEG, DuelPolicy
from kvoffload.tiers.cpu.manager import CPUOffloadingManager

from tests.policies.test_chain import keys, turn


def test_an_agent_context_larger_than_the_cache_switches_to_segchain_and_keeps_its_head():
    """ARC's loop: every turn re-reads a context larger than the cache, stores
    its tail over its head and, from the seventh turn, misses at block 0. The
    segchain shadow keeps its sampled head, wins, and the live cache follows."""
    m = CPUOffloadingManager(256, "duel")
    assert m.policy.mode == ARC  # ARC first: it needs its history from the start
    hits = [turn(m, keys(0, 200 + 40 * t), step=16) for t in range(12)]
    assert m.policy.mode == SEG
    assert all(h >= 100 for h in hits[6:])  # each later turn reads a head it kept
    arc = CPUOffloadingManager(256, "arc")
    assert [turn(arc, keys(0, 200 + 40 * t), step=16) for t in range(12)][7:] == [0] * 5


def _ctx(ks: list[bytes]) -> ReqContext:
    ctx = ReqContext("r")
    ctx.set_offload_key_positions(ks, range(16, 16 * (len(ks) + 1), 16))
    return ctx


def _stored(pol: DuelPolicy, ks: list[bytes]) -> ReqContext:
    """A request that stores ks, as the manager calls the policy."""
    ctx = _ctx(ks)
    pol.admit(ks, pol.capacity - len(pol), ctx, lambda k: True)
    pol.insert(ks, ctx)
    pol.refresh(ks, ctx)
    return ctx


def test_a_switch_to_segchain_keeps_the_recency_order_and_the_hits():
    pol = DuelPolicy(64)
    a, b = keys(1, 4), keys(2, 4)
    _stored(pol, a)
    _stored(pol, b)
    pol.touch(a, _ctx(a))  # a later request reads a: a is newest, and hit
    pol._to_seg()
    assert pol.mode == SEG and len(pol) == 8 and all(k in pol for k in a + b)
    assert pol._seg._hit == set(a)
    assert pol.evict(4, lambda k: True) == b[::-1]  # b is least recent: it goes first, tail first


def test_a_switch_to_arc_puts_hit_keys_in_t2():
    pol = DuelPolicy(64)
    pol._to_seg()
    a, b = keys(1, 4), keys(2, 4)
    _stored(pol, a)
    _stored(pol, b)
    pol.touch(a, _ctx(a))
    pol._to_arc()
    assert pol.mode == ARC and len(pol) == 8
    assert list(pol.live.t2) and set(pol.live.t2) == set(a) and set(pol.live.t1) == set(b)


@pytest.mark.parametrize("scores, mode", [((100.0, 130.0), ARC), ((130.0, 100.0), SEG), ((100.0, 100.1), ARC)])  # within MARGIN: no switch
def test_it_follows_the_better_shadow_once_they_turned_over(scores, mode):
    pol = DuelPolicy(64)
    pol._score = list(scores)
    pol._decide()
    assert pol.mode == ARC  # the shadows have not evicted anything yet: no evidence
    pol._churn = pol._shadow_cap
    pol._decide()
    assert pol.mode == mode


KEYS = keys(3, 16)
op = st.one_of(
    st.tuples(st.just("store"), st.integers(0, 15), st.integers(1, 6)),
    st.tuples(st.just("touch"), st.integers(0, 15), st.integers(1, 6)),
    st.tuples(st.just("remove"), st.integers(0, 15), st.just(0)),
    st.tuples(st.just("evict"), st.integers(0, 8), st.sets(st.integers(0, 15), max_size=16)),
    st.tuples(st.just("switch"), st.just(0), st.just(0)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, max_size=60), capacity=st.integers(1, 10))
def test_the_contract_holds_across_switches(ops, capacity):
    """Held keys match a model across switches either way; evict returns
    evictable held keys only; a refused evict changes nothing."""
    pol = DuelPolicy(capacity)
    held: set[bytes] = set()
    for name, a, b in ops:
        if name == "store":
            ks = KEYS[a:a + b]
            ctx = _ctx(ks)
            new = [k for k in ks if k not in held][:max(capacity - len(held), 0)]
            if new:
                n = pol.admit(new, capacity - len(held), ctx, lambda k: True)
                assert 0 <= n <= len(new)
                pol.insert(new[:n], ctx)
                held.update(new[:n])
        elif name == "touch":
            pol.touch(KEYS[a:a + b], ReqContext("t"))
        elif name == "remove":
            pol.remove(KEYS[a])
            held.discard(KEYS[a])
        elif name == "switch":
            pol._to_seg() if pol.mode == ARC else pol._to_arc()
        else:
            pinned = {KEYS[i] for i in b}
            before = deep_state(pol)
            out = pol.evict(a, lambda k: k not in pinned)
            if out is None:
                assert deep_state(pol) == before
            else:
                assert len(out) == a == len(set(out)) and set(out) <= held - pinned
                held -= set(out)
        assert len(pol) == len(held)
        assert all((k in pol) == (k in held) for k in KEYS)
