import pytest

from kvoffload.replay.oracle import simulate


TRACE = [[1, 2, 3], [1, 4], [1, 2, 3], [1, 4]]


def test_lru_by_hand():
    # cap 3. r0 stores 1,2,3 (LRU order 3,2,1). r1: hit 1; storing 4 evicts 3.
    # r2: hits 1,2; storing 3 evicts 4. r3: hit 1.
    r = simulate(TRACE, 3, "lru")
    assert (r.prefix_hits, r.block_refs) == (4, 10)


def test_belady_by_hand():
    # r1's block 4 is needed later than every resident block: not admitted,
    # so r2 hits all three and r3 hits block 1.
    r = simulate(TRACE, 3, "belady")
    assert (r.prefix_hits, r.block_refs) == (5, 10)


def test_prefix_only_counts_leading_run():
    # block 2 is resident but block 9 before it is not: no prefix hit past the miss
    r = simulate([[1, 2], [9, 2]], 10, "lru")
    assert r.prefix_hits == 0


@pytest.mark.parametrize("cap", [1, 2, 5, 100])
def test_belady_never_worse_than_lru(cap):
    trace = [[0, 1, 2], [0, 1, 3], [0, 4], [0, 1, 2, 5], [0, 4, 6], [0, 1, 3]] * 3
    assert simulate(trace, cap, "belady").prefix_hits >= simulate(trace, cap, "lru").prefix_hits


def test_unknown_oracle():
    with pytest.raises(ValueError, match="unknown oracle 'fifo'"):
        simulate(TRACE, 3, "fifo")
