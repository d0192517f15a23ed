"""A request's recency is committed when it finishes (request_record.py):
what it loaded counts as reused, except what it stored itself and read back."""

from kvoffload.abstractions import ReqContext
from kvoffload.keys import make_offload_key
from kvoffload.tiers.cpu.manager import CPUOffloadingManager


def K(i: int) -> bytes:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def store(m, c, ids):
    out = m.prepare_store([K(i) for i in ids], c)
    assert out is not None
    m.complete_store(out.keys_to_store, c)


def load(m, c, ids):
    keys = [K(i) for i in ids]
    m.prepare_load(keys, c)
    m.complete_load(keys, c)


def test_reading_back_its_own_stores_is_not_a_reuse_a_load_of_anothers_is():
    """ARC tells the two apart: a reuse moves a block to T2 (used twice), a
    block only stored stays in T1. A request that stores blocks and then
    loads them (a promotion from a lower tier reads what it just wrote) has
    not used them twice."""
    m = CPUOffloadingManager(8, "arc")
    first = ReqContext("r0")
    m.on_new_request(first)
    store(m, first, [0])
    m.on_request_finished(first)
    c = ReqContext("r1")
    m.on_new_request(c)
    load(m, c, [0])  # r0's block: a reuse
    store(m, c, [1, 2])
    load(m, c, [1, 2])  # its own, read back
    m.on_request_finished(c)
    assert list(m.policy.t2) == [K(0)]
    assert set(m.policy.t1) == {K(1), K(2)}


def test_a_request_that_loads_before_it_stores_counts_every_load():
    m = CPUOffloadingManager(8, "arc")
    first = ReqContext("r0")
    m.on_new_request(first)
    store(m, first, [0, 1])
    m.on_request_finished(first)
    c = ReqContext("r1")
    m.on_new_request(c)
    load(m, c, [0, 1])
    store(m, c, [2])
    m.on_request_finished(c)
    assert set(m.policy.t2) == {K(0), K(1)} and list(m.policy.t1) == [K(2)]
