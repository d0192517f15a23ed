"""SIEVE: visited keys survive the hand, the hand keeps its place."""

from kvoffload.policies import get_policy_class
from kvoffload.policies.sieve import SIEVEPolicy


def K(i: int) -> bytes:
    return i.to_bytes(8, "big") + b"\0\0\0\0"


def always(_k):
    return True


def test_registered():
    assert get_policy_class("sieve") is SIEVEPolicy


def test_visited_keys_survive_one_pass():
    p = SIEVEPolicy(5)
    p.insert([K(i) for i in range(5)], None)  # tail first: 4 is the oldest
    p.touch([K(4), K(3)], None)
    assert p.evict(2, always) == [K(2), K(1)]
    assert K(4) in p and K(3) in p
    assert K(4) not in p.visited  # the hand cleared its bit


def test_hand_keeps_its_place_and_wraps():
    p = SIEVEPolicy(4)
    p.insert([K(1), K(2), K(3), K(4)], None)  # order old->new: 4 3 2 1
    p.touch([K(4), K(3), K(2), K(1)], None)
    assert p.evict(1, always) == [K(4)]  # a full lap clears all, then 4 goes
    p.insert([K(5)], None)
    assert p.evict(1, always) == [K(3)]  # the hand continued after 4


def test_pinned_never_evicted_and_refusal_changes_nothing():
    p = SIEVEPolicy(4)
    p.insert([K(1), K(2), K(3), K(4)], None)
    p.touch([K(2)], None)
    pinned = {K(1), K(2), K(3)}
    before = (dict(p.newer), dict(p.older), set(p.visited), p.hand, p.oldest, p.newest)
    assert p.evict(2, lambda k: k not in pinned) is None
    assert (dict(p.newer), dict(p.older), set(p.visited), p.hand, p.oldest, p.newest) == before
    assert p.evict(1, lambda k: k not in pinned) == [K(4)]


def test_remove_moves_the_hand():
    p = SIEVEPolicy(4)
    p.insert([K(1), K(2), K(3)], None)
    p.touch([K(3)], None)
    p.evict(1, always)  # 3 visited: cleared, 2 evicted; hand on 1
    p.remove(K(1))
    assert p.hand is None or p.hand in p.newer
    assert p.evict(1, always) == [K(3)]
    assert len(p) == 0
