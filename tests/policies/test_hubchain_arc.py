"""`hubchain`'s ARC split of the rest (p, B1, B2) and the hub branches' own
target q with their ghosts, through the CPU manager."""

from kvoffload.policies.hubchain.policy import HubChainPolicy
from kvoffload.tiers.cpu.manager import CPUOffloadingManager

from tests.policies.turns import keys, turn

HUB = HubChainPolicy.HUB


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
