"""Prefix-aware LRU: tails first, ghost counts, self-enabling leaf demotion
and reuse protection, exact undo of a refused evict."""

import copy

from kvoffload.abstractions import ReqContext
from kvoffload.policies import get_policy_class
from kvoffload.policies.prefix import PrefixAwarePolicy


def K(i: int) -> bytes:
    return i.to_bytes(8, "big") + b"\0\0\0\0"


def ks(*ids):
    return [K(i) for i in ids]


def always(_k):
    return True


def test_registered():
    assert get_policy_class("prefix") is PrefixAwarePolicy


def test_fresh_policy_is_lru_with_tail_first():
    p = PrefixAwarePolicy(6)
    p.insert(ks(1, 2, 3), ReqContext("a"))
    p.insert(ks(4, 5, 6), ReqContext("b"))
    p.touch(ks(1, 2), ReqContext("c"))
    assert p.evict(4, always) == ks(3, 6, 5, 4)
    assert p.evict(2, always) == ks(2, 1)


def test_ghost_resumes_the_reuse_count():
    p = PrefixAwarePolicy(4)
    p.insert(ks(1, 2), None)
    p.touch(ks(1, 2), None)
    assert sorted(p.evict(2, always)) == ks(1, 2)
    p.insert(ks(1, 2), None)  # a re-store is a reuse: count 1 -> 2
    assert p.order[K(1)] & 7 == 4 + 2
    assert p.order[K(2)] & 7 == 3 - 2  # the tail is a leaf


def test_leaf_gets_a_child_in_a_later_call_of_the_same_request():
    p = PrefixAwarePolicy(8)
    ctx = ReqContext("r")
    p.insert(ks(1, 2), ctx)
    assert p.order[K(2)] & 7 < 4  # leaf
    p.insert(ks(3), ctx)  # decode blocks continue the run
    assert p.order[K(2)] & 7 >= 4
    assert p.order[K(3)] & 7 < 4


def test_never_reused_leaves_get_demoted_and_reused_ones_do_not():
    # Requests share a 3-block prefix and end in a unique (partial) block.
    p = PrefixAwarePolicy(50)
    for i in range(300):
        ctx = ReqContext(str(i))
        held = [k for k in ks(1, 2, 3) if k in p]
        if held:
            p.touch(held, ctx)
        new = [k for k in ks(1, 2, 3) + [K(1000 + i)] if k not in p]
        need = len(p) + len(new) - 50
        if need > 0:
            p.evict(need, always)
        p.insert(new, ctx)
    assert p.demote
    assert next(iter(p.order)) == K(1299)  # the newest leaf sits at the old end

    # A chat: every turn extends the previous one, leaves included.
    q = PrefixAwarePolicy(400)
    for s in range(40):
        chain = []
        for turn in range(4):
            ctx = ReqContext(f"{s}-{turn}")
            if chain:
                q.touch(list(chain), ctx)
            new = ks(*range(10_000 * s + 3 * turn, 10_000 * s + 3 * turn + 3))
            need = len(q) + len(new) - 400
            if need > 0:
                q.evict(need, always)
            q.insert(new, ctx)
            chain += new
    assert not q.demote


def test_reused_blocks_outlive_fresh_ones_when_reuse_predicts_reuse():
    p = PrefixAwarePolicy(20)
    p.protect = True  # as measured on a workload where reuse predicts reuse
    p.reuse_age = 100.0
    p.insert(ks(1, 2), None)
    p.touch(ks(1, 2), None)  # 1: reused once, inner
    for i in range(10, 28):
        p.insert([K(i)], None)
    out = p.evict(5, always)
    assert K(1) not in out and K(1) in p


def test_pinned_never_evicted_and_refused_evict_restores_exactly():
    p = PrefixAwarePolicy(6)
    p.protect = True
    p.reuse_age = 1000.0
    p.insert(ks(1, 2, 3), None)
    p.touch(ks(1, 2), None)  # protected: second chances during evict
    p.insert(ks(4, 5, 6), None)
    before = copy.deepcopy(p.__dict__)
    pinned = set(ks(3, 4, 5, 6))
    assert p.evict(3, lambda k: k not in pinned) is None
    assert p.__dict__ == before
    out = p.evict(2, lambda k: k not in pinned)
    assert sorted(out) == ks(1, 2)
    assert all(k in p for k in pinned)


def test_remove_and_reinsert():
    p = PrefixAwarePolicy(3)
    p.insert(ks(1, 2, 3), None)
    p.remove(K(2))
    p.remove(K(9))  # unknown: no-op
    assert len(p) == 2 and K(2) not in p
    p.insert(ks(2), None)
    assert len(p) == 3
