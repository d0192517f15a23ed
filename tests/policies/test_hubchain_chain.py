"""hubchain's prefix-chain base (policies/hubchain/chain.py), through the
CPU manager as vLLM drives it: a store never breaks the chain it reads."""

import pytest

from kvoffload.abstractions import ReqContext
from kvoffload.tiers.cpu.manager import CPUOffloadingManager

from tests.policies.turns import keys, turn


def test_a_context_larger_than_the_cache_keeps_its_head():
    """LRU's loop pathology: every turn re-reads a growing context larger
    than the cache. LRU (as vLLM 0.33's: a running request's reads rank with
    its stores, tail first) keeps only part of the head; hubchain keeps the
    head and refuses the tail."""
    hits = {}
    for policy in ("lru", "hubchain"):
        m = CPUOffloadingManager(10, policy)
        hits[policy] = [turn(m, keys(0, 12 + 4 * t)) for t in range(6)]
    assert hits["hubchain"] == [0] + [10] * 5
    assert sum(hits["lru"]) < sum(hits["hubchain"]), hits["lru"]


def test_a_store_never_evicts_its_own_prefix_and_stops_at_the_first_refusal():
    m = CPUOffloadingManager(6, "hubchain")
    prompt = keys(0, 10)
    ctx = ReqContext("r")
    for i, k in enumerate(prompt):
        ctx.set_offload_key_position(k, (i + 1) * 64)
    out = m.prepare_store(prompt[:4], ctx)
    m.complete_store(out.keys_to_store, ctx)
    out = m.prepare_store(prompt[4:8], ctx)
    assert out.keys_to_store == prompt[4:6] and out.evicted_keys == []  # a head of the new keys
    m.complete_store(out.keys_to_store, ctx)
    out = m.prepare_store(prompt[8:], ctx)
    assert out.keys_to_store == []  # after the hole: useless
    assert all(k in m for k in prompt[:6])


def test_a_chain_idle_longer_than_the_requests_interval_is_evicted():
    """A conversation that stopped coming back gives way to a live one."""
    m = CPUOffloadingManager(8, "hubchain")
    turn(m, keys(9, 4))  # comes once, never again
    for t in range(6):
        turn(m, keys(0, 4 + t))  # comes every request
    assert not any(k in m for k in keys(9, 4))
    assert all(k in m for k in keys(0, 8))


def test_without_a_context_it_evicts_like_lru():
    victims = {}
    for policy in ("lru", "hubchain"):
        m = CPUOffloadingManager(4, policy)
        for i in range(6):
            k = keys(i, 1)
            out = m.prepare_store(k, None)
            m.complete_store(out.keys_to_store, None)
            if i == 3:
                m.touch(keys(0, 1), None)
        victims[policy] = sorted(k for i in range(6) for k in keys(i, 1) if k not in m)
    assert victims["hubchain"] == victims["lru"]


def test_low_retention_blocks_go_first():
    m = CPUOffloadingManager(8, "hubchain")
    turn(m, keys(0, 4))
    turn(m, keys(1, 4), params={"kv_retention": "low"})
    turn(m, keys(2, 4))
    assert all(k in m for k in keys(0, 4)) and all(k in m for k in keys(2, 4))
    assert not any(k in m for k in keys(1, 4))


@pytest.mark.parametrize("swapped", [False, True])
def test_the_deepest_resident_block_before_a_store(swapped):
    """Found from the deep end, as positions are set in prefix order (vLLM's
    connector, the replay); positions met out of order on the way: a full
    walk, with the same answer."""
    m = CPUOffloadingManager(64, "hubchain")
    pol = m.policy
    prompt = keys(0, 12)
    for i, k in enumerate(prompt[:8]):
        if i != 6:  # block 6 is not resident: the deepest resident before block 8 is block 7
            pol._order[k] = 100 + i
    ctx = ReqContext("r")
    order = list(enumerate(prompt))
    if swapped:
        order[-2], order[-1] = order[-1], order[-2]  # the deep end set out of order
    for i, k in order:
        ctx.set_offload_key_position(k, (i + 1) * 64)
    assert pol._prefix_end(prompt[8:], ctx) == (107, prompt[7])
    del pol._order[prompt[7]]
    assert pol._prefix_end(prompt[8:], ctx) == (105, prompt[5])
    pol._order.clear()
    assert pol._prefix_end(prompt[8:], ctx) == (None, None)
