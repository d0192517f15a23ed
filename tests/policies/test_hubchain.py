"""The `hubchain` policy: blocks stored right after a hub (a block many
requests branched from) age faster by an adaptive shift; ARC's split of the
rest; hub heads held longer."""

import hypothesis.strategies as st
import pytest
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


def _feed(pol: HubChainPolicy, cls: int, distances: list[int], n: int) -> None:
    """n sampled episodes of class cls, reused at the given distances in turn
    (0: never), as _follow records them."""
    from kvoffload.policies.hubchain.learning import BINS, _bin
    for i in range(n):
        d = distances[i % len(distances)]
        pol._dist[cls][_bin(d) if d else BINS] += 1.0
    pol._started[cls] += n


def test_the_split_keeps_the_class_whose_reuse_a_longer_life_catches():
    """Conversations (the rest) come back after 200 requests, one-shot hub
    branches never. 3.2 episodes per request each: equal lives that fit (L
    <= 156) catch no reuse, so the split gives the rest 200 and the branches
    what is left (< 112): shift > 88. With both reused alike, or with room
    for everything, it favours neither (shift 0)."""
    from kvoffload.policies.hubchain.learning import A, B
    shifts = []
    for follow in (1.0, HubChainPolicy.FOLLOW):
        pol = HubChainPolicy(1000)
        pol.FOLLOW = follow
        pol._clock = 1000
        _feed(pol, A, [200], 3200)
        _feed(pol, B, [0], 3200)
        pol._split()
        shifts.append(pol.shift)
    assert shifts[0] > 88  # the split's target
    assert shifts[1] == HubChainPolicy.FOLLOW * shifts[0]  # shift moves part of the way there
    pol = HubChainPolicy(4096)  # room for the rest's 640 and the branches' 200 lives
    pol._clock = 1000
    _feed(pol, A, [200], 3200)
    _feed(pol, B, [0], 3200)
    pol._split()
    assert pol.shift == 0.0
    pol = HubChainPolicy(4096)
    pol._clock = 1000
    _feed(pol, A, [20, 40], 3200)
    _feed(pol, B, [20, 40], 3200)
    pol._split()
    assert pol.shift == 0.0
    pol = HubChainPolicy(4096)
    pol._clock = 1000
    _feed(pol, A, [200], 10)  # too few episodes to judge: no change
    _feed(pol, B, [0], 10)
    pol._split()
    assert pol.shift == 0.0


def test_the_split_aims_at_no_shift_while_the_sampled_reuses_show_it_losing_to_lru():
    """The same curves as above (target > 88), with what this cache did to
    the sampled reuses: LRU's life here is the bin of about 150 requests, so
    hits at 200 are gains and misses at 20 losses. The target stands while
    gains are at least GAIN_OVER_LRU times the losses; else shift aims at 0."""
    from kvoffload.policies.hubchain.learning import A, B, _bin
    shifts = []
    for hits_at_200, misses_at_20 in ((0.0, 0.0), (100.0, 40.0), (100.0, 60.0), (0.0, 1.0)):
        pol = HubChainPolicy(1000)
        pol.FOLLOW = 1.0
        pol._clock = 1000
        _feed(pol, A, [200], 3200)
        _feed(pol, B, [0], 3200)
        pol._hit_at[_bin(200)] = hits_at_200
        pol._miss_at[_bin(20)] = misses_at_20
        pol._split()
        shifts.append(pol.shift)
        assert pol._hit_at[_bin(200)] == hits_at_200 * pol.CHECK_MEMORY  # remembered, decayed
    assert shifts[0] > 88 and shifts[1] == shifts[0]  # no evidence, or gains >= 2x losses: the model's target
    assert shifts[2] == 0.0 and shifts[3] == 0.0  # losses over half the gains: none


def test_a_hit_and_a_miss_record_the_reuse_on_their_side():
    from kvoffload.policies.hubchain.learning import A, B, _bin
    pol = HubChainPolicy(4)  # every key sampled
    k1, k2 = keys(1, 1) + keys(2, 1)
    pol._clock = 10
    pol._follow([k1, k2], B, False)  # first uses: no reuse yet
    pol._clock = 40
    pol._follow([k1], A, True)
    pol._follow([k2], B, False)
    pol._drain()  # (logged uses are followed in one batch, at a split or here)
    assert pol._hit_at[_bin(30)] == 1.0 and sum(pol._hit_at) == 1.0
    assert pol._miss_at[_bin(30)] == 1.0 and sum(pol._miss_at) == 1.0


def test_reuse_distances_are_followed_on_a_sample_whatever_the_cache_keeps():
    """A class sampled at 1 in 2**rate starts episodes on keys whose hash byte
    is a multiple of 2**rate, each weighted 2**rate; any later use of a key
    ends its episode, whatever class or rate it is used under then."""
    from kvoffload.policies.hubchain.learning import A, B, BINS, _bin
    pol = HubChainPolicy(4)
    assert pol._rate == [0, 0]  # a small cache: every key, until the first split
    pol._rate = [0, 3]  # hub branches 1 in 8, the rest all
    pol._low = 0
    sampled = [bytes([0] * 7 + [8 * i]) + b"\0" * 4 for i in range(1, 4)]  # hash byte % 8 == 0
    other = bytes([0] * 7 + [3]) + b"\0" * 4
    pol._clock = 10
    pol._follow(sampled + [other], B, False)
    pol._drain()
    assert set(pol._episodes) == set(sampled) and pol._started[B] == 3 * 8
    pol._clock = 42
    pol._follow(sampled[:1] + [other], A, True)  # reused 32 requests later: a B episode ends, A ones start
    pol._drain()  # (before the rates change: they change only at a split, which drains first)
    assert pol._dist[B][_bin(32)] == 8.0 and sum(pol._dist[B]) == 8.0
    assert set(pol._episodes) == set(sampled) | {other} and pol._started[A] == 2
    pol._rate = [3, 3]  # both 1 in 8 now: `other` is no longer sampled, its A episode still ends
    pol._clock = 50
    pol._follow([other], B, False)
    pol._drain()
    assert pol._dist[A][_bin(8)] == 1.0 and other not in pol._episodes
    # an episode no reuse ends within the horizon counts as never reused, with its weight
    pol._clock = 10**6
    pol._split()
    assert pol._episodes == {} and pol._dist[B][BINS] > 0


def test_the_first_sampling_rate_follows_the_capacity():
    assert HubChainPolicy(400)._rate == [0, 0]
    assert HubChainPolicy(16384)._rate == [3, 3]  # about TARGET keys of a capacity/4 window


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


def _steady(m: CPUOffloadingManager) -> HubChainPolicy:
    """The manager's policy with the warm-up off: one step of P_STEP from the first miss."""
    m.policy.WARM_GAIN = 1.0
    return m.policy


def _ghosts(pol: HubChainPolicy, b1: list[bytes], b2: list[bytes]) -> None:
    for k in b1:
        pol._b1[k] = None
    for k in b2:
        pol._b2[k] = None


def test_a_first_miss_on_a_ghost_moves_the_loose_target_as_arc_does():
    """ARC's rule, on a request's first miss only: a ghost of a loose block
    (B1) raises p, a ghost of a block that was hit (B2) lowers it, by P_STEP
    times the other list's size over its own (at least 1, at most
    RATIO_MAX), within [0, c]."""
    m = CPUOffloadingManager(256, "hubchain")
    pol = _steady(m)
    assert pol._p == 256.0  # LRU's split until a ghost says otherwise
    _ghosts(pol, keys(1, 2), keys(2, 6))
    turn(m, keys(2, 6)[3:])  # its first miss is a B2 ghost (the next two too: only the first counts)
    assert pol._p == 256.0 - pol.P_STEP * 1.0  # |B1| / |B2| = 2/6 < 1
    _ghosts(pol, [], keys(3, 4))  # B1 2 ghosts, B2 3 + 4
    turn(m, keys(1, 1))
    assert pol._p == 256.0  # raised by P_STEP * 7/2, up to the capacity
    pol._p = 10.0
    turn(m, keys(1, 2)[1:])
    assert pol.RATIO_MAX == 4.0
    assert pol._p == 10.0 + pol.P_STEP * 4.0  # B1 holds one ghost now, B2 seven: 7/1, capped at 4
    turn(m, keys(6, 3))  # a miss on no ghost
    assert pol._p == 10.0 + pol.P_STEP * 4.0


def test_a_b2_ghost_among_many_b1_ghosts_lowers_p_by_at_most_ratio_max_steps():
    """Uncapped, one B2 ghost beside a long B1 list moved p down by |B1|/|B2|
    steps while a B1 ghost moved it up by one, so a low p held itself low."""
    m = CPUOffloadingManager(256, "hubchain")
    pol = _steady(m)
    _ghosts(pol, keys(1, 100), keys(2, 1))
    turn(m, keys(2, 1))
    assert pol._p == 256.0 - pol.P_STEP * pol.RATIO_MAX  # 100/1, capped
    turn(m, keys(1, 100)[50:])
    assert pol._p == 256.0 - pol.P_STEP * pol.RATIO_MAX + pol.P_STEP  # up by one step: B2 is empty now


def test_p_and_q_take_larger_steps_while_the_cache_has_seen_few_first_misses():
    """The warm-up: a step is P_STEP * max(1, WARM_GAIN / (1 + n / WARM_MISSES))
    at the n-th first miss (counted on every request's first miss, on a
    ghost or not), so 4 steps at the start, 2 at the 1,000th, one from the
    3,000th on."""
    m = CPUOffloadingManager(4096, "hubchain")
    pol = m.policy
    assert (pol.WARM_GAIN, pol.WARM_MISSES, pol.P_STEP) == (4.0, 1000, 4.0)
    pol._hub_ghosts.update((k, None) for k in keys(1, 3))
    _ghosts(pol, [], keys(2, 8))
    turn(m, keys(2, 8)[:1])  # the first first miss: a B2 ghost lowers p and q
    warm = 4.0 * 4.0 / (1 + 1 / 1000)
    assert pol._p == 4096.0 - warm and pol._q == 4096.0 - warm
    for i in range(998):  # misses on no ghost count too
        turn(m, keys(100 + i, 1))
    assert pol._learned == 999
    turn(m, keys(1, 3)[:1])  # the 1,000th: a hub ghost raises q by two steps
    assert pol._q == 4096.0 - warm + 4.0 * 2.0
    pol._learned = 2999
    q = pol._q
    turn(m, keys(1, 3)[1:2])  # the 3,000th: one step
    assert pol._q == q + 4.0
    pol._learned = 10**6
    p = pol._p
    turn(m, keys(2, 8)[1:2])  # long after: one step (B1 is empty: ratio 1)
    assert pol._p == p - 4.0


def test_p_never_falls_below_its_floor_q_may_reach_0():
    """A B2 first miss lowers p to P_FLOOR of the capacity at most (ARC's
    ratio can pin p near 0, where chat rows lost to LRU); q has no floor."""
    m = CPUOffloadingManager(256, "hubchain")
    pol = _steady(m)
    assert pol.P_FLOOR == 0.1
    pol._p, pol._q = 27.0, 2.0
    pol._hub_ghosts.update((k, None) for k in keys(3, 1))
    _ghosts(pol, [], keys(2, 4))
    turn(m, keys(2, 4)[:1])  # 27 - 4 would be 23
    assert pol._p == 0.1 * 256 and pol._q == 0.0
    turn(m, keys(2, 4)[1:2])
    assert pol._p == 0.1 * 256
    _ghosts(pol, keys(4, 1), [])
    turn(m, keys(4, 1))  # a B1 ghost still raises it
    assert pol._p > 0.1 * 256


def test_a_ghost_of_a_hit_block_stored_again_joins_the_chain_order_a_loose_ghost_stays_loose():
    m = CPUOffloadingManager(64, "hubchain")
    pol = m.policy
    _ghosts(pol, keys(1, 2), keys(2, 2))
    turn(m, keys(1, 2) + keys(2, 2) + keys(3, 2), step=6)
    assert all(k in pol._loose for k in keys(1, 2) + keys(3, 2))  # new, or used once before: never hit
    assert all(k in pol._order for k in keys(2, 2))  # a second use of a block that was hit (ARC: T2)
    assert not pol._b1 and not pol._b2


def test_the_loose_order_goes_first_while_it_holds_more_than_p():
    m = CPUOffloadingManager(8, "hubchain")
    pol = m.policy
    turn(m, keys(1, 4))
    turn(m, keys(1, 4))  # hit: chain's order now
    turn(m, keys(2, 4))  # loose, newer
    assert list(pol._order) == list(reversed(keys(1, 4))) and len(pol._loose) == 4
    pol._p = 1.0
    turn(m, keys(3, 3))  # room for 3: the loose order is 3 over p
    assert all(k in pol._order for k in keys(1, 4))  # the older blocks that were hit stay
    assert [k in pol._loose for k in keys(2, 4)] == [True, False, False, False]  # the tail first
    pol._p = 8.0
    turn(m, keys(4, 3))  # LRU's split again: the oldest go, whichever order
    assert not any(k in pol._order for k in keys(1, 4)[1:]) and keys(2, 4)[0] in pol._loose


def test_ghosts_are_trimmed_to_arcs_bounds():
    """Each eviction trims the ghosts to |loose| + |B1| <= c and resident +
    |B1| + |B2| <= 2c (the oldest go, B2's before B1's); a store only takes
    ghosts away."""
    m = CPUOffloadingManager(8, "hubchain")
    pol = m.policy
    drop = pol._drop
    after = []

    def drop_and_check(victims):
        drop(victims)
        after.append((len(pol._loose) + len(pol._b1), len(pol) + len(pol._b1) + len(pol._b2)))

    pol._drop = drop_and_check
    for c in range(1, 40):
        turn(m, keys(c, 3))
        if c % 4 == 0:
            turn(m, keys(c, 3))  # some blocks are hit: B2 ghosts later
        assert len(pol._b1) <= 8 and len(pol._b1) + len(pol._b2) <= 16
    assert len(after) > 30 and all(loose_b1 <= 8 and all_ <= 16 for loose_b1, all_ in after)
    assert pol._b1 and pol._b2


def _hub_branches(m: CPUOffloadingManager, first: int, n: int) -> list[bytes]:
    """A hub (a system block), HUB - 1 first branches, then n hub branch
    requests of one block each (keys(first + i, 1)); their keys."""
    system = keys(0, 1)
    turn(m, system)
    for i in range(1, HUB):
        turn(m, system + keys(1000 + i, 1))
    branch = []
    for i in range(n):
        turn(m, system + keys(first + i, 1))
        branch += keys(first + i, 1)
    return branch


def test_a_hub_branch_victim_never_hit_leaves_a_hub_ghost_and_a_store_takes_it_back():
    m = CPUOffloadingManager(HUB + 3, "hubchain")  # the hub, its HUB - 1 first branches, 3 hub branches
    pol = _steady(m)
    branch = _hub_branches(m, 1, 3)
    assert list(pol._hubbed) == branch and len(pol) == HUB + 3  # full
    pol._q = 0.0  # the hub branch order goes first
    out = m.prepare_store(keys(70, 2), None)
    assert out.evicted_keys == branch[:2]
    assert list(pol._hub_ghosts) == branch[:2]
    assert not any(k in pol._b1 or k in pol._b2 for k in branch[:2])  # not ARC's ghosts: q's
    turn(m, keys(0, 1) + branch[:2])  # both stored again: the first miss's ghost is learned from, both go
    assert not any(k in pol._hub_ghosts for k in branch[:2])
    assert pol._q == pol.P_STEP


def test_hub_ghosts_are_at_most_the_capacity_oldest_go_first():
    m = CPUOffloadingManager(16, "hubchain")
    pol = m.policy
    branch = _hub_branches(m, 1, 5)
    pol._hub_ghosts.update((k, None) for k in keys(500, 15))  # 15 older ghosts
    pol._drop(branch[:3])
    assert len(pol._hub_ghosts) == 16
    assert list(pol._hub_ghosts)[-3:] == branch[:3] and keys(500, 2)[0] not in pol._hub_ghosts


def test_a_first_miss_on_a_hub_ghost_raises_q_on_a_b2_ghost_lowers_it_by_equal_steps():
    """ARC's rule for the hub branch order against the blocks that were hit,
    without the ratio: a request's first miss on a hub ghost raises q, one
    on a B2 ghost lowers it (only while hub ghosts exist), one on a B1 ghost
    leaves it; p moves on B1 and B2 ghosts as before."""
    m = CPUOffloadingManager(256, "hubchain")
    pol = _steady(m)
    assert pol._q == 256.0
    _ghosts(pol, keys(1, 2), keys(2, 6))
    turn(m, keys(2, 6)[2:])  # no hub ghosts yet: q stays
    assert pol._q == 256.0 and pol._p == 256.0 - pol.P_STEP
    pol._hub_ghosts.update((k, None) for k in keys(3, 3))
    turn(m, keys(2, 6)[:1])
    assert pol._q == 256.0 - pol.P_STEP
    p = pol._p
    turn(m, keys(1, 2)[1:])  # a B1 ghost: p's business only
    assert pol._q == 256.0 - pol.P_STEP and pol._p > p
    p = pol._p
    turn(m, keys(3, 3)[1:])  # a hub ghost (the next one too: only the first counts)
    assert pol._q == 256.0 and pol._p == p
    assert list(pol._hub_ghosts) == [keys(3, 3)[0]]
    pol._q = 1.0
    turn(m, keys(2, 6)[1:2])  # down to 0 at most
    assert pol._q == 0.0


def test_the_hub_branch_order_goes_first_while_it_holds_more_than_q():
    m = CPUOffloadingManager(HUB + 4, "hubchain")  # the hub, its HUB - 1 first branches, then 5 hub branches
    pol = m.policy
    branch = _hub_branches(m, 1, 5)
    assert len(pol) == HUB + 4 and list(pol._hubbed) == branch
    pol._q = 3.0
    out = m.prepare_store(keys(70, 3), None)  # room for 3: the hub branch order is 2 over q
    assert out.evicted_keys[:2] == branch[:2]
    assert branch[2] not in out.evicted_keys  # then the rest's pick: the oldest blocks
    assert all(k in pol._hubbed for k in branch[2:])


def _shadow_case(ours: float, lru: float, misses_at_20: float) -> float:
    """The curves above (the model's target > 88) with the shadow LRU's
    evidence (uses only this cache hit, uses only the shadow hit) and the
    model check's (hits at 200 against misses at 20): the shift after one split."""
    from kvoffload.policies.hubchain.learning import A, B, _bin
    pol = HubChainPolicy(1000)
    pol.FOLLOW = 1.0
    pol._clock = 1000
    _feed(pol, A, [200], 3200)
    _feed(pol, B, [0], 3200)
    pol._hit_at[_bin(200)] = 100.0
    pol._miss_at[_bin(20)] = misses_at_20
    pol._sim_ours, pol._sim_lru = ours, lru
    pol._split()
    return pol.shift


def test_the_shadow_lru_decides_the_split_where_its_evidence_is_significant():
    """Where the uses the cache and the shadow LRU disagree on lean one way by
    more than SIM_Z standard deviations of a sign test, that decides the
    gate; else the model check does (gains at least GAIN_OVER_LRU times the
    losses)."""
    passes, fails = 40.0, 60.0  # the model check's verdict: 100 >= 2 * 40, 100 < 2 * 60
    assert _shadow_case(0.0, 0.0, passes) > 88 and _shadow_case(0.0, 0.0, fails) == 0.0
    assert _shadow_case(10.0, 40.0, passes) == 0.0  # LRU ahead by 30 > 2 * sqrt(50): no shift
    assert _shadow_case(40.0, 10.0, fails) > 88  # the cache ahead: the target stands
    assert _shadow_case(10.0, 20.0, passes) > 88  # 10 < 2 * sqrt(30): the model decides
    assert _shadow_case(20.0, 10.0, fails) == 0.0


def test_the_shadow_lru_counts_the_uses_it_and_the_cache_disagree_on_while_shift_is_on():
    from kvoffload.policies.hubchain.learning import A, B
    pol = HubChainPolicy(8)  # the shadow holds every key, 8 of them
    assert pol._sim_rate == 0
    a, b = keys(1, 3), keys(2, 3)
    pol._follow(a, B, False)  # stored after a miss: new to the shadow too
    pol._follow(a, A, True)  # hit by both: no count either way
    pol._follow(b, A, True)  # hit by the cache only (shift 0: not counted)
    pol._drain()  # (before the shift changes: it changes only at a split, which drains first)
    assert pol._sim_ours == 0.0 and pol._sim_lru == 0.0
    pol.shift = pol.SIM_ON
    pol._follow(b, A, False)  # missed by the cache, hit by the shadow
    pol._follow(keys(3, 2), A, True)  # hit by the cache, new to the shadow
    pol._drain()
    assert pol._sim_lru == 3.0 and pol._sim_ours == 2.0
    assert list(pol._sim) == a[::-1] + b[::-1] + keys(3, 2)[::-1]  # oldest first; each call's head newest
    pol._follow(keys(3, 2), A, False)  # missed by the cache, hit by the shadow
    pol._drain()
    assert pol._sim_lru == 5.0


def test_the_shadow_lru_samples_keys_by_hash_and_shrinks_its_capacity_alike():
    """At 2**s times SIM_BLOCKS blocks, 1 key in 2**s (hash byte a multiple
    of 2**s) enters a shadow of capacity/2**s keys (SHARDS)."""
    pol = HubChainPolicy(8 * HubChainPolicy.SIM_BLOCKS)
    assert pol._sim_rate == 3
    ks = keys(1, 256)  # hash bytes 0..255
    pol._follow(ks, 0, False)
    pol._drain()
    assert sorted(pol._sim) == sorted(ks[::8])
    for c in range(2, 80):  # 78 * 32 sampled keys: more than the shadow holds
        pol._follow(keys(c, 256), 0, False)
    pol._drain()
    assert len(pol._sim) == pol.capacity >> 3 == HubChainPolicy.SIM_BLOCKS


def test_the_shadow_lru_evidence_decays_at_every_split():
    pol = HubChainPolicy(8)
    pol.insert(keys(1, 8), None)
    pol._sim_ours, pol._sim_lru = 10.0, 20.0
    assert pol.evict(2, lambda k: True) is not None  # a quarter of the capacity evicted: a split
    assert pol._sim_ours == 10.0 * pol.SIM_MEMORY and pol._sim_lru == 20.0 * pol.SIM_MEMORY


def test_the_shadow_lrus_verdict_outlasts_the_shifts_fall():
    """Its evidence grows only while the shift is on, and an "LRU ahead"
    verdict brings the shift down over some 30 splits. Forgotten faster than
    that, the verdict faded, the model check raised the shift again and it
    swung (version 13 on convo-judge14 at 1%). 200 splits later it holds."""
    from kvoffload.policies.hubchain.learning import BINS
    pol = HubChainPolicy(8)
    pol.insert(keys(1, 8), None)
    pol._sim_ours, pol._sim_lru = 0.0, 30.0
    for i in range(200):
        pol.insert(keys(i + 2, 2), None)
        assert pol.evict(2, lambda k: True) is not None  # a quarter of the capacity: a split each
    no_model_evidence = [0.0] * BINS
    assert not pol._beats_lru(no_model_evidence, no_model_evidence)  # LRU still ahead
    pol._sim_lru = 0.0
    assert pol._beats_lru(no_model_evidence, no_model_evidence)  # (without it the model check lets it stand)


def test_hash_bytes_are_each_keys_own_with_one_length_or_mixed():
    from kvoffload.policies.hubchain.loops import _HASH_BYTE
    from kvoffload.policies.hubchain.loops import hash_bytes as _hash_bytes
    same = keys(1, 40)
    assert _hash_bytes(same) == bytes(map(_HASH_BYTE, same)) == bytes(range(40))
    mixed = [b"\x07" * 12, b"\x09" * 8, b"\x05" * 10]  # lengths 12, 8, 10 (not 3 x 12): key by key
    assert _hash_bytes(mixed) == b"\x07\x09\x05"
    assert _hash_bytes([]) == b""


def _follow_state(pol: HubChainPolicy) -> tuple:
    return (pol._dist, pol._hit_at, pol._miss_at, pol._started, pol._seen, pol._live,
            list(pol._episodes.items()), list(pol._sim), pol._sim_ours, pol._sim_lru)


def _follow_one_call(pol: HubChainPolicy, keys: list[bytes], cls: int, hit: bool) -> None:
    """The reference: one call followed at once, key by key (version 13's
    _follow, which the judged rows ran)."""
    from kvoffload.policies.hubchain.learning import _BIN_OF, _WEIGHT, BINS
    from kvoffload.policies.hubchain.loops import _HASH_BYTE
    pol._seen[cls] += len(keys)
    s = pol._sim_rate
    sim = [k for k in keys if _HASH_BYTE(k) % (1 << s) == 0]
    if sim:
        if pol.shift >= pol.SIM_ON:
            found = sum(k in pol._sim for k in sim)
            if hit:
                pol._sim_ours += len(sim) - found
            else:
                pol._sim_lru += found
        for k in sim:
            pol._sim.pop(k, None)
        for k in reversed(sim):
            pol._sim[k] = None
        while len(pol._sim) > pol.capacity >> s:
            pol._sim.popitem(last=False)
    k_rate, now = pol._rate[cls], pol._clock
    cand = [k for k in keys if _HASH_BYTE(k) % (1 << pol._low) == 0]
    ended = [pol._episodes.pop(k, None) for k in cand]
    started = 0
    for k in cand:
        if _HASH_BYTE(k) % (1 << k_rate) == 0 and k not in pol._episodes:
            pol._episodes[k] = (now << 8) | (k_rate << 1) | cls
            started += 1
    pol._started[cls] += started << k_rate
    pol._live[k_rate] += started
    for e in ended:
        if e is not None:
            d, ek = now - (e >> 8), (e >> 1) & 127
            pol._live[ek] -= 1
            b = _BIN_OF[d] if d < len(_BIN_OF) - 1 else BINS - 1
            pol._dist[e & 1][b] += _WEIGHT[ek]
            (pol._hit_at if hit else pol._miss_at)[b] += _WEIGHT[ek]


@settings(max_examples=150, deadline=None)
@given(capacity=st.sampled_from([8, 64, 4 * HubChainPolicy.SIM_BLOCKS]),
       rates=st.tuples(st.integers(0, 3), st.integers(0, 3)),
       shift=st.sampled_from([0.0, HubChainPolicy.SIM_ON]),
       calls=st.lists(st.tuples(st.lists(st.integers(0, 47), max_size=12), st.integers(0, 1),
                                st.booleans(), st.integers(0, 3)), max_size=40),
       drain_every=st.sampled_from([1, 5, 1000]), batched=st.booleans())
def test_logged_uses_are_followed_in_batches_as_one_call_at_a_time(capacity, rates, shift, calls, drain_every,
                                                                   batched):
    """Where few keys are sampled _follow only logs, and _drain follows a
    batch of calls at once (vectorized); else each call is followed at once
    (_follow_now). The state either leaves (reuse distances, episodes in
    their order, the shadow LRU in its order and its counts) is the one the
    reference leaves, to the last bit of every float (the sums start at
    values where adds round, so their order shows): keys reused within a
    batch and across batches, twice in one call, under two sampling rates,
    with the shadow counting or not."""
    from kvoffload.policies.hubchain.learning import A, B
    pool = keys(1, 48)  # hash bytes 0..47: every rate samples some
    ref, pol = HubChainPolicy(capacity), HubChainPolicy(capacity)
    pol._batched = batched  # (set by the sampling rates: here both ways at every capacity)
    for p in (ref, pol):
        p._rate, p._low, p.shift = list(rates), min(rates), shift
        big = 2.0 ** 53  # adds of 1, 2, 4, 8 round here: their order shows in the result
        p._hit_at = [big + 2 * b for b in range(len(p._hit_at))]
        p._miss_at = [0.3 * (b % 5) for b in range(len(p._miss_at))]
        p._dist[A][:] = [big] * len(p._dist[A])
        p._dist[B][:] = [0.7 * (b % 3) for b in range(len(p._dist[B]))]
        p._started = [big, 0.2]
        p._clock = 1
    _follow_one_call(ref, pool[::3], 1, False)  # episodes and shadow keys from an earlier batch
    pol._follow(pool[::3], 1, False)
    pol._drain()
    for n, (idx, cls, hit, step) in enumerate(calls, 1):
        for p in (ref, pol):
            p._clock += step
        _follow_one_call(ref, [pool[i] for i in idx], cls, hit)
        pol._follow([pool[i] for i in idx], cls, hit)
        if n % drain_every == 0:
            pol._drain()
    pol._drain()
    assert _follow_state(pol) == _follow_state(ref)
