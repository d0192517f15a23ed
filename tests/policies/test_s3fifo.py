"""S3-FIFO: quick demotion of keys seen once, promotion of reused ones."""

from kvoffload.policies import get_policy_class
from kvoffload.policies.s3fifo import S3FIFOPolicy


def K(i: int) -> bytes:
    return i.to_bytes(8, "big") + b"\0\0\0\0"


def always(_k):
    return True


def test_registered():
    assert get_policy_class("s3fifo") is S3FIFOPolicy


def test_keys_seen_once_go_before_reused_ones():
    p = S3FIFOPolicy(10)  # small queue: 1 key
    p.insert([K(i) for i in range(10)], None)
    p.touch([K(3), K(4)], None)
    out = p.evict(7, always)  # the small queue drains first; 3 and 4 moved to main
    assert K(3) not in out and K(4) not in out
    assert K(3) in p.main and K(4) in p.main
    assert K(3) in p and K(4) in p


def test_tail_goes_before_head():
    p = S3FIFOPolicy(10)
    p.insert([K(1), K(2), K(3)], None)
    assert p.evict(1, always) == [K(3)]


def test_ghost_hit_enters_main():
    p = S3FIFOPolicy(10)
    p.insert([K(1)], None)
    assert p.evict(1, always) == [K(1)]
    p.insert([K(1)], None)  # re-stored soon after eviction
    assert K(1) in p.main
    p.insert([K(i) for i in range(2, 11)], None)
    assert K(1) not in p.evict(5, always)


def test_pinned_never_evicted_and_refusal_changes_nothing():
    p = S3FIFOPolicy(4)
    p.insert([K(1), K(2), K(3), K(4)], None)
    p.touch([K(2)], None)
    pinned = {K(1), K(2), K(3)}
    before = (list(p.small.items()), list(p.main.items()), list(p.ghost))
    assert p.evict(2, lambda k: k not in pinned) is None
    assert (list(p.small.items()), list(p.main.items()), list(p.ghost)) == before
    assert p.evict(1, lambda k: k not in pinned) == [K(4)]
    assert len(p) == 3


def test_all_pinned_in_small_takes_from_main():
    p = S3FIFOPolicy(10)
    p.insert([K(1)], None)
    p.touch([K(1)], None)
    p.evict(0, always)
    p.insert([K(i) for i in range(2, 11)], None)
    out = p.evict(1, lambda k: k == K(1) or k in p.main)
    assert out is not None and len(out) == 1
