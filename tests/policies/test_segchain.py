"""The `segchain` policy: chain's rules, but blocks of a new chain are loose
(unshielded) until their first hit."""

import pytest

from kvoffload.abstractions import ReqContext
from kvoffload.policies.segchain import SegChainPolicy
from kvoffload.tiers.cpu.manager import CPUOffloadingManager

from tests.policies.test_chain import keys, turn


def test_a_context_larger_than_the_cache_keeps_its_head():
    m = CPUOffloadingManager(10, "segchain")
    hits = [turn(m, keys(0, 12 + 4 * t)) for t in range(6)]
    assert hits == [0] + [10] * 5


def test_a_conversation_back_after_a_scan_evicts_the_scan_not_its_own_head():
    """chain shields the scan's fresh blocks (used once, recently): the
    conversation coming back may not evict them and its new blocks are
    refused. In segchain the scan's blocks are loose and go first."""
    got = {}
    for policy in ("chain", "segchain"):
        m = CPUOffloadingManager(24, policy)
        for _ in range(4):
            turn(m, keys(0, 8))  # a live conversation, reused every request
        for s in range(1, 5):
            turn(m, keys(100 + s, 4))  # a scan: new chains read once
        turn(m, keys(0, 8) + keys(1, 12))  # it comes back with 12 new blocks
        got[policy] = sum(k in m for k in keys(1, 12))
        assert all(k in m for k in keys(0, 8))
    assert got["segchain"] == 12
    assert got["chain"] < 12


def test_a_hit_moves_a_loose_block_under_the_shield():
    m = CPUOffloadingManager(8, "segchain")
    turn(m, keys(0, 4))  # a new chain: loose
    pol = m.policy
    assert isinstance(pol, SegChainPolicy)
    assert all(k in pol._loose for k in keys(0, 4))
    turn(m, keys(0, 6))  # its next turn hits them
    assert not any(k in pol._loose for k in keys(0, 4))
    assert all(k in pol._order for k in keys(0, 4))
    assert all(k in pol._order for k in keys(0, 6)[4:])  # stored by a continuing chain: shielded


def test_f_never_rises_above_one():
    pol = SegChainPolicy(4)
    for i in range(40):
        k = i.to_bytes(12, "big")
        pol._evicted[k] = None
        pol._learn(k)  # evictions that cost hits raise f: up to 1 only
    assert pol.f == 1.0


def test_a_store_landing_after_the_finish_is_still_loose():
    """vLLM finishes a request in the step it submits its last store, and
    the store completes after: a new chain's blocks must still be loose
    (the manager passes the request; it once passed None, and segchain put
    every such block in chain's order)."""
    m = CPUOffloadingManager(8, "segchain")
    ctx = ReqContext("r")
    for i, k in enumerate(keys(0, 4)):
        ctx.set_offload_key_position(k, (i + 1) * 64)
    out = m.prepare_store(keys(0, 4), ctx)
    m.on_request_finished(ctx)
    m.complete_store(out.keys_to_store, ctx)
    assert all(k in m.policy._loose for k in keys(0, 4))


def test_admits_count_is_reused_by_the_evict_that_follows_and_dropped_by_any_change():
    """admit walks the victims it counts; the evict that follows takes them
    without a second walk, but only if nothing changed in between."""
    pol = SegChainPolicy(4)
    old = keys(0, 4)
    pol.insert(old, None)
    ctx = ReqContext("r")
    new = keys(1, 2)
    for i, k in enumerate(new):
        ctx.set_offload_key_position(k, (i + 1) * 64)
    can_evict = lambda k: True  # noqa: E731
    assert pol.admit(new, 0, ctx, can_evict) == 2
    assert pol._picked is not None and pol._picked[1] == old[::-1][:2]  # the tail first
    pol.remove(old[3])  # a change: the count is stale
    assert pol._picked is None
    victims = pol.evict(2, can_evict)
    assert old[3] not in victims and len(victims) == 2
    ctx2 = ReqContext("r2")
    ctx2.set_offload_key_position(keys(2, 1)[0], 64)
    assert pol.admit(keys(2, 1), 0, ctx2, can_evict) == 1  # one key left to evict
    other = lambda k: True  # noqa: E731  (another can_evict: walk again)
    assert pol.evict(1, other) == [old[0]] and pol._picked is None


@pytest.mark.parametrize("swapped", [False, True])
def test_the_deepest_resident_block_before_a_store(swapped):
    """Found from the deep end, as positions are set in prefix order (vLLM's
    connector, the replay); positions met out of order on the way: a full
    walk, with the same answer."""
    pol = SegChainPolicy(64)
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
