"""kv_retention "low": a request that says its blocks will not be reused
stores them where they go first and refreshes nothing it reads."""

import pytest

from kvoffload.abstractions import ReqContext
from kvoffload.keys import make_offload_key
from kvoffload.tiers.cpu.manager import CPUOffloadingManager

HONOURING = ["lru", "hubchain"]  # policies that implement insert_cold (hubchain: the default)


def K(i: int) -> bytes:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def ctx(rid: str, low: bool = False) -> ReqContext:
    return ReqContext(rid, {"kv_retention": "low"} if low else None)


def run_request(m, c, reads=(), writes=()):
    """One request's manager calls, in a scheduler's order."""
    m.on_new_request(c)
    reads = [K(i) for i in reads]
    if reads:
        m.prepare_load(reads, c)
        m.touch(reads, c)
        m.complete_load(reads, c)
    writes = [K(i) for i in writes]
    if writes:
        out = m.prepare_store(writes, c)
        assert out is not None
        m.complete_store(out.keys_to_store, c)
    m.on_request_finished(c)
    return out.evicted_keys if writes else []


@pytest.mark.parametrize("policy", HONOURING)
def test_low_retention_blocks_are_evicted_first_tail_first(policy):
    m = CPUOffloadingManager(4, policy)
    run_request(m, ctx("a"), writes=[1, 2])
    run_request(m, ctx("b", low=True), writes=[3, 4])  # newer, but said to be dead
    evicted = run_request(m, ctx("c"), writes=[5])
    assert evicted == [K(4)]  # the low request's tail, not the older normal blocks
    evicted = run_request(m, ctx("d"), writes=[6])
    assert evicted == [K(3)]
    assert all(m.lookup(K(i), None).name == "HIT" for i in (1, 2, 5, 6))


@pytest.mark.parametrize("policy", HONOURING)
def test_low_retention_reads_do_not_refresh(policy):
    def victim_after(low_reader: bool) -> bytes:
        m = CPUOffloadingManager(2, policy)
        run_request(m, ctx("a"), writes=[1])
        run_request(m, ctx("b"), writes=[2])
        run_request(m, ctx("r", low=low_reader), reads=[1])  # reads the older block
        (v,) = run_request(m, ctx("c"), writes=[3])
        return v

    assert victim_after(low_reader=False) == K(2)  # a normal read makes block 1 the newest
    assert victim_after(low_reader=True) == K(1)  # a low read leaves it the oldest


def test_low_blocks_still_hit_until_pushed_out():
    m = CPUOffloadingManager(8, "lru")
    run_request(m, ctx("a", low=True), writes=[1, 2, 3])
    assert [m.lookup(K(i), None).name for i in (1, 2, 3)] == ["HIT"] * 3


def test_bad_retention_value_is_ignored_named_and_counted(caplog):
    m = CPUOffloadingManager(4, "lru")
    run_request(m, ctx("a"), writes=[1, 2])
    with caplog.at_level("WARNING", logger="kvoffload.hints"):
        run_request(m, ReqContext("x", {"kv_retention": "forever"}), writes=[3, 4])
    assert [r.getMessage() for r in caplog.records] == [
        "request 'x': ignoring kv_retention='forever': must be 'low' or 'normal'"]
    assert m.get_stats().counters["bad_request_hints"] == 1
    assert run_request(m, ctx("c"), writes=[5]) == [K(2)]  # a's tail: x stored normal blocks, not cold ones


@pytest.mark.parametrize("value", ["LOW", " low ", "Low"])
def test_retention_value_case_and_spaces_do_not_matter(value):
    m = CPUOffloadingManager(4, "lru")
    run_request(m, ctx("a"), writes=[1, 2])
    run_request(m, ReqContext("b", {"kv_retention": value}), writes=[3, 4])
    assert run_request(m, ctx("c"), writes=[5]) == [K(4)]
    assert m.get_stats().counters["bad_request_hints"] == 0


def test_policy_without_cold_insert_treats_hint_as_normal_store():
    m = CPUOffloadingManager(4, "arc")
    run_request(m, ctx("a", low=True), writes=[1, 2])
    assert len(m.policy) == 2 and all(m.lookup(K(i), None).name == "HIT" for i in (1, 2))
