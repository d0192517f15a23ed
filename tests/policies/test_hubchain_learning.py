"""`hubchain`'s learned shift (policies/hubchain/learning.py): the split from
sampled reuse distances, its LRU checks (the sampled reuses, the shadow
LRU), and the uses followed at once or in batches to the same state."""

import hypothesis.strategies as st
from hypothesis import given, settings

from kvoffload.policies.hubchain.policy import HubChainPolicy

from tests.policies.turns import keys


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
