"""The `hubchain` policy: blocks stored right after a hub (a block many
requests branched from) age faster by an adaptive shift; ARC's split of the
rest; hub heads held longer."""

import hypothesis.strategies as st
from hypothesis import given, settings

from kvoffload.abstractions import ReqContext
from kvoffload.policies.hubchain.policy import HubChainPolicy
from kvoffload.tiers.cpu.manager import CPUOffloadingManager

from tests.policies.turns import keys, turn

HUB = HubChainPolicy.HUB


def test_branches_off_a_block_go_to_the_hub_order_once_it_is_a_hub():
    m = CPUOffloadingManager(64, "hubchain")
    pol = m.policy
    system = keys(0, 2)
    turn(m, system)
    for i in range(1, HUB + 1):
        turn(m, system + keys(i, 2))
    for i in range(1, HUB):  # branches 1..HUB-1: ordinary chain blocks
        assert not any(k in pol._hubbed for k in keys(i, 2))
    assert all(k in pol._hubbed for k in keys(HUB, 2))
    assert pol._branches[system[-1]] == HUB
    turn(m, system + keys(HUB, 2) + keys(99, 1))  # its first hit: a continued branch
    assert not any(k in pol._hubbed for k in keys(HUB, 2)) and all(k in pol._order for k in keys(HUB, 2))
    assert keys(99, 1)[0] in pol._loose  # a continuation is no hub branch (its parent has one branch): never hit yet


def _hub_and_chain(shift: float) -> tuple[CPUOffloadingManager, list[bytes], list[bytes]]:
    """A full cache: the hub and its first branches, a chain (stored before)
    and a hub branch (stored after it)."""
    m = CPUOffloadingManager(2 + (HUB - 1) + 4 + 2, "hubchain")
    system = keys(0, 2)
    turn(m, system)
    for i in range(1, HUB):
        turn(m, system + keys(i, 1))
    for i in range(1, HUB):  # keep the hub and its first branches in use
        turn(m, system + keys(i, 1))
    chain = keys(50, 4)
    turn(m, chain)
    turn(m, system + keys(HUB, 2))  # the hub branch, stored after the chain
    m.policy.shift = shift
    return m, chain, keys(HUB, 2)


def test_with_no_shift_the_older_goes_first_and_with_a_shift_the_hub_branch():
    m, _, branch = _hub_and_chain(0.0)
    assert all(k in m.policy._hubbed for k in branch)
    out = m.prepare_store(keys(70, 2), None)
    assert len(out.evicted_keys) == 2 and not set(out.evicted_keys) & set(branch)  # LRU: older blocks
    m, _, branch = _hub_and_chain(1000.0)
    out = m.prepare_store(keys(70, 2), None)
    assert sorted(out.evicted_keys) == sorted(branch)  # counted older by the shift


def test_a_running_requests_loaded_head_is_held_until_it_finishes():
    """Another request's store may not evict the head a running request
    loaded (its tail, stored next, would be unreachable without it)."""
    m = CPUOffloadingManager(8, "hubchain")
    head = keys(0, 4)
    turn(m, head)
    ctx = ReqContext("running")
    for i, k in enumerate(head + keys(0, 6)[4:]):
        ctx.set_offload_key_position(k, (i + 1) * 64)
    m.on_new_request(ctx)
    m.prepare_load(head, ctx)
    m.complete_load(head, ctx)
    turn(m, keys(1, 4))  # fills the cache
    turn(m, keys(2, 4))  # must evict: keys(1, ...) go, the held head stays
    assert all(k in m for k in head)
    assert not any(k in m for k in keys(1, 4))
    m.on_request_finished(ctx)
    assert not m.policy._held
    turn(m, keys(3, 4))  # the finish committed the head's use: the older keys(2, ...) go
    assert all(k in m for k in head) and not any(k in m for k in keys(2, 4))


def test_a_key_evicted_lately_and_stored_again_by_a_branch_joins_the_chain_order():
    m = CPUOffloadingManager(2 + (HUB - 1) + 4, "hubchain")
    system = keys(0, 2)
    turn(m, system)
    for i in range(1, HUB):
        turn(m, system + keys(i, 1))
    pol = m.policy
    back = keys(HUB, 2)
    pol._recent[back[0]] = None  # as if evicted a moment ago
    turn(m, system + back)  # a branch off the hub
    assert back[0] in pol._order and back[1] in pol._hubbed


def test_a_store_landing_after_the_finish_keeps_its_request_class():
    """vLLM finishes a request in the step it submits the last store; the
    store completes later and still goes to its request's order."""
    m = CPUOffloadingManager(64, "hubchain")
    system = keys(0, 2)
    turn(m, system)
    for i in range(1, HUB):
        turn(m, system + keys(i, 1))
    ctx = ReqContext("late")
    prompt = system + keys(HUB, 2)
    for i, k in enumerate(prompt):
        ctx.set_offload_key_position(k, (i + 1) * 64)
    m.prepare_load(system, ctx)
    m.complete_load(system, ctx)
    out = m.prepare_store(prompt[2:], ctx)
    m.on_request_finished(ctx)
    m.complete_store(out.keys_to_store, ctx)
    assert all(k in m.policy._hubbed for k in keys(HUB, 2))


def test_one_shot_prompts_after_a_preamble_give_way_to_returning_conversations():
    """Six one-shot prompts per round branch off a shared preamble and are
    never read again; eight conversations come back every other round. In
    LRU order the one-shots push every conversation out before it returns;
    hubchain's split learns that only the conversations are reused and lets
    the one-shots go first."""
    hits = {}
    for policy in ("lru", "hubchain"):
        m = CPUOffloadingManager(64, policy)
        pre, n, one = keys(0, 2), 0, 1
        for r in range(200):
            for c in range(8):
                if (r + c) % 2 == 0:
                    n += turn(m, keys(1000 + c, 6))
            for _ in range(6):
                turn(m, pre + keys(one, 4))
                one += 1
        hits[policy] = n
    assert m.policy.shift > 0
    assert hits["hubchain"] > 3 * hits["lru"], hits


def test_a_head_two_running_requests_loaded_is_held_until_both_finish():
    m = CPUOffloadingManager(16, "hubchain")
    head = keys(0, 4)
    turn(m, head)
    ctxs = []
    for name in ("a", "b"):
        ctx = ReqContext(name)
        for i, k in enumerate(head):
            ctx.set_offload_key_position(k, (i + 1) * 64)
        m.on_new_request(ctx)
        m.prepare_load(head[:3] if name == "a" else head, ctx)  # a loads 3 of the 4
        m.complete_load(head[:3] if name == "a" else head, ctx)
        ctxs.append(ctx)
    pol = m.policy
    assert pol._held == set(head) and pol._held_more == {k: 2 for k in head[:3]}
    m.on_request_finished(ctxs[0])
    assert pol._held == set(head) and not pol._held_more  # b still holds all four
    m.on_request_finished(ctxs[1])
    assert not pol._held


def test_no_reuse_interval_shield():
    """No block is shielded for the storing request's own reuse interval
    (with many conversations at once such a shield refused stores LRU made
    room for): a conversation back after another's turn stores its next
    blocks over the other's."""
    stored = True
    m = CPUOffloadingManager(8, "hubchain")
    for n in (2, 4):  # two conversations, each back once (hit: chain blocks, not loose)
        turn(m, keys(0, n))
        turn(m, keys(1, n))  # full at the end
    turn(m, keys(0, 6))  # conversation 0 again: 4 hits, 2 new blocks
    assert all(k in m for k in keys(0, 6)) is stored
    assert all(k in m for k in keys(1, 4)) is not stored


def _hub_head_then_chain(shift: float) -> tuple[CPUOffloadingManager, list[bytes], list[bytes], list[bytes]]:
    """A full cache: a hub (two system blocks) and its first branches, a hub
    branch (whose hit makes the system blocks a hub head), then a chain."""
    m = CPUOffloadingManager(2 + (HUB - 1) + 2 + 4, "hubchain")
    system = keys(0, 2)
    turn(m, system)
    for i in range(1, HUB):
        turn(m, system + keys(i, 1))
    turn(m, system + keys(HUB, 2))
    chain = keys(50, 4)
    turn(m, chain)
    m.policy.shift = shift
    return m, system, keys(HUB, 2), chain


def test_a_hub_branch_requests_head_lives_longer_by_the_shift():
    m, system, branch, chain = _hub_head_then_chain(0.0)
    pol = m.policy
    assert all(k in pol._heads for k in system) and not any(k in pol._order for k in system)
    assert all(k in pol._hubbed for k in branch) and all(k in pol._order or k in pol._loose for k in chain)
    pol.HEAD_FLOOR = 0.0  # (version 15's rule)
    need = (HUB - 1) + 2 + 2
    out = m.prepare_store(keys(70, need), None)
    assert set(system) <= set(out.evicted_keys)  # no shift, no floor: LRU, the head is older than the chain
    assert not set(chain) & set(out.evicted_keys)
    m, system, branch, chain = _hub_head_then_chain(0.0)
    out = m.prepare_store(keys(70, need), None)
    # no shift yet, but the head is newer by HEAD_GAIN * HEAD_FLOOR requests (version 16): the chain goes first
    assert not set(system) & set(out.evicted_keys) and len(set(chain) & set(out.evicted_keys)) == 2
    m, system, branch, chain = _hub_head_then_chain(1000.0)
    out = m.prepare_store(keys(70, need), None)
    assert set(branch) <= set(out.evicted_keys)  # the branch counts older by the shift
    assert not set(system) & set(out.evicted_keys)  # the head newer by HEAD_GAIN shifts: the chain goes first
    assert len(set(chain) & set(out.evicted_keys)) == 2


def test_a_hub_head_stays_a_head_when_other_requests_hit_it():
    m, system, _, _ = _hub_head_then_chain(0.0)
    pol = m.policy
    before = pol._heads[system[0]]
    turn(m, system + keys(HUB, 2) + keys(99, 1))  # a continued branch hits the head again
    assert all(k in pol._heads for k in system) and pol._heads[system[0]] > before
    assert list(pol._heads)[-1] == system[0]  # renewed, the tail older than the head


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_the_pick_takes_blocks_by_shifted_last_use_ties_to_the_lower_order(data):
    """_pick against its definition: while the hub branch order holds more
    than q blocks, its oldest evictable ones first, as many as it is over;
    then the rest's pick, without those: while the loose order holds more
    than p blocks, its oldest evictable ones first, as many as it is over;
    then every block of the four orders sorted by last use + the order's
    offset (ties: loose, chain's, hub branches, heads, then the older
    block), chain's order cut at its first shielded block; the first n that
    are not the store's own, not held and may be evicted."""
    pol = HubChainPolicy(64)
    pol.shift = data.draw(st.sampled_from([0.0, 1.0, 2.5, 7.0]))
    pol._p = data.draw(st.sampled_from([64.0, 0.0, 2.0, 5.5]))
    pol._q = data.draw(st.sampled_from([64.0, 0.0, 1.0, 3.5]))
    orders = (pol._loose, pol._order, pol._hubbed, pol._heads)  # in the order ties go
    offsets = (0.0, 0.0, -pol.shift, pol.HEAD_GAIN * max(pol.shift, pol.HEAD_FLOOR))
    blocks = []  # (shifted use, order, place in it, key, use)
    n_key = 0
    for i, seg in enumerate(orders):
        uses = sorted(data.draw(st.lists(st.integers(0, 12), max_size=8)))  # each order oldest first
        for place, u in enumerate(uses):
            k = bytes([n_key]) * 8
            n_key += 1
            seg[k] = u
            blocks.append((u + offsets[i], i, place, k, u))
    keys = [b[3] for b in blocks]
    pol._threshold = data.draw(st.sampled_from([5, 9, float("inf")]))
    pol._own = {k: 1 for k in data.draw(st.lists(st.sampled_from(keys), max_size=3))} if keys else None
    pol._held = set(data.draw(st.lists(st.sampled_from(keys), max_size=3))) if keys else set()
    stuck = set(data.draw(st.lists(st.sampled_from(keys), max_size=3))) if keys else set()

    def can_evict(k):
        return k not in stuck

    def may_go(k):
        return k not in (pol._own or ()) and k not in pol._held and can_evict(k)

    can_evict.all = lambda ks: not stuck.intersection(ks)
    n = data.draw(st.integers(1, 10))
    over = len(pol._loose) - int(pol._p)
    first = [k for k in pol._loose if may_go(k)][:min(n, over)] if over > 0 else []
    cut = min((b[2] for b in blocks if b[1] == 1 and b[4] >= pol._threshold), default=None)
    ranked = sorted(b for b in blocks if not (b[1] == 1 and cut is not None and b[2] >= cut))
    rest = first + [b[3] for b in ranked if may_go(b[3]) and b[3] not in first][:n - len(first)]
    over_q = len(pol._hubbed) - int(pol._q)
    hub_first = [k for k in pol._hubbed if may_go(k)][:min(n, over_q)] if over_q > 0 else []
    want = hub_first + [k for k in rest if k not in hub_first][:n - len(hub_first)]
    assert pol._pick(n, can_evict) == want
    del can_evict.all  # a manager without the batch check: asked key by key
    assert pol._pick(n, can_evict) == want
