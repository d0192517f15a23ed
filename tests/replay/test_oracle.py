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


def _tier(cap, composite=False):
    return {"composite": composite, "counters": {}, "gauges": {} if cap is None else {"capacity_blocks": cap}}


def test_tiered_oracle_also_at_all_tiers_capacity():
    from kvoffload.replay.oracle import replay_oracles

    cpu_only = replay_oracles(TRACE, {"cpu": _tier(1)}, 99)
    b1 = simulate(TRACE, 1, "belady").hit_rate
    assert cpu_only == {"capacity_blocks": 1, "lru": simulate(TRACE, 1, "lru").hit_rate, "belady": b1,
                        "per_tier": {"cpu": {"capacity_blocks": 1, "belady": b1}}}
    tiered = replay_oracles(TRACE, {"tiered": _tier(None, True), "cpu": _tier(1), "storage": _tier(2)}, 99)
    assert tiered["capacity_blocks"] == 1 and tiered["lru"] == cpu_only["lru"]
    assert tiered["all_tiers_capacity_blocks"] == 3
    assert tiered["all_tiers_lru"] == simulate(TRACE, 3, "lru").hit_rate > tiered["lru"]
    assert tiered["all_tiers_belady"] == simulate(TRACE, 3, "belady").hit_rate
    # a lower tier of unknown capacity (remote): no all-tiers figure, not a wrong one
    assert "all_tiers_lru" not in replay_oracles(TRACE, {"cpu": _tier(1), "remote": _tier(None)}, 99)


def test_tiered_replay_report_labels_both_oracles(tmp_path, capsys):
    from kvoffload.cli import main

    rc = main(["replay", "--sessions", "6", "--no-progress", "--oracle", "--cpu-blocks", "20",
               "--storage-dir", str(tmp_path / "kv"), "--storage-bytes", "1MiB"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "oracle at CPU tier alone, 20 blocks" in out
    assert "oracle at all tiers' capacity, " in out
    assert "prefix hit rate" in out and "lookup hit rate" in out
