"""`hubchain`'s hot loops, in Python and in C: over its orders (the pick,
the drop to ghosts, renewals), the resident-prefix walk, and the learning's
sampled reuses with the shadow LRU.

An order is an OrderedDict of key -> last use (the clock, in requests),
oldest first. These loops run for every block a request stores, hits or
evicts, so they are the policy's cost per block (kept within 1.5x of
LRU's). The C module `_hubchain_loops` (_hubchain_loops*.c) has the same
functions, built at install by setup.py (optional: without a compiler these
run). Both make the same changes to the same OrderedDicts, in the same
order, and return the same values: tests/policies/test_hubchain_loops.py
drives both with random operations and compares. Set
KVOFFLOAD_NATIVE_LOOPS=0 to use these.

`may_go(k)`: k is not in `own` (the storing request's key positions: a
store never evicts its own request's keys) nor in `held` (keys running
requests loaded), and `can_evict` (None: every key may) says yes.
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict, deque
from collections.abc import Callable
from itertools import chain, compress, repeat
from operator import itemgetter


def stamp(od: OrderedDict, keys: list[bytes], now) -> None:
    """od[k] = now for each key, tail first: a new key lands at the newest
    end (the tail older than the head); a known one keeps its place."""
    for k in reversed(keys):
        od[k] = now


def renew(od: OrderedDict, keys: list[bytes], now: int) -> None:
    """od's keys among `keys` used now, each moved to the newest end, the
    head last (newest)."""
    move = od.move_to_end
    for k in reversed(keys):
        if k in od:
            od[k] = now
            move(k)


def renew_all(od: OrderedDict, keys: list[bytes], now: int) -> bool:
    """renew when od holds every key (the common case: a request's own
    stores, all in one order); else False and no change (the caller then
    renews those od holds)."""
    if not all(map(od.__contains__, keys)):
        return False
    deque(map(od.move_to_end, reversed(keys)), 0)
    for k in keys:
        od[k] = now
    return True


def touch(keys: list[bytes], order: OrderedDict, loose: OrderedDict, heads: OrderedDict,
          hubbed: OrderedDict, used: int, now: int) -> None:
    """A hit outside a hub branch, tail first: a key of the chain order is used
    at `used` and moves to its newest end; a loose or hub branch key (its
    first hit) moves to the chain order at `used`; a hub head is used `now`
    and moves to the heads' newest end. Other keys are ignored."""
    move, move_head = order.move_to_end, heads.move_to_end
    for k in reversed(keys):
        if k in order:
            order[k] = used
            move(k)
        elif k in loose:
            del loose[k]
            order[k] = used
        elif k in heads:
            heads[k] = now
            move_head(k)
        elif k in hubbed:
            del hubbed[k]
            order[k] = used


def drop(victims: list[bytes], order: OrderedDict, loose: OrderedDict, hubbed: OrderedDict,
         heads: OrderedDict, b1: OrderedDict, b2: OrderedDict, hub_ghosts: OrderedDict,
         recent: OrderedDict, branches: dict, c: int) -> None:
    """Each victim leaves its order for ARC's ghosts: chain's and heads' to
    B2, loose to B1, a hub branch's to B1 and the hub branch ghosts; all to
    `recent` (at most c, oldest out) and out of `branches`. Then ARC's
    bounds, oldest first: |loose| + |B1| <= c, resident + |B1| + |B2| <= 2c
    (B2 before B1). A never-hit hub branch victim is a loose one there: it
    takes room in B1 while B1 is trimmed, then goes (a hub branch's ghosts
    are `recent`'s and the hub branch ghosts', at most c)."""
    branch_ghosts = None
    for k in victims:
        if order.pop(k, None) is not None:
            b2[k] = None
        elif loose.pop(k, None) is not None:
            b1[k] = None
        elif hubbed.pop(k, None) is not None:
            b1[k] = None
            hub_ghosts[k] = None
            if branch_ghosts is None:
                branch_ghosts = []
            branch_ghosts.append(k)
        else:
            del heads[k]
            b2[k] = None
    for k in victims:
        recent[k] = None
    if branches:
        deque(map(branches.pop, victims, repeat(None)), 0)
    if len(recent) > c:  # the oldest ghosts go, in one C loop
        deque(map(recent.popitem, repeat(False, len(recent) - c)), 0)
    over = min(len(loose) + len(b1) - c, len(b1))
    if over > 0:
        deque(map(b1.popitem, repeat(False, over)), 0)
    over = len(order) + len(loose) + len(hubbed) + len(heads) + len(b1) + len(b2) - 2 * c
    if over > 0:
        from2 = min(over, len(b2))
        deque(map(b2.popitem, repeat(False, from2)), 0)
        deque(map(b1.popitem, repeat(False, min(over - from2, len(b1)))), 0)
    if branch_ghosts:
        deque(map(b1.pop, branch_ghosts, repeat(None)), 0)
        over = len(hub_ghosts) - c
        if over > 0:
            deque(map(hub_ghosts.popitem, repeat(False, over)), 0)


def merge(n: int, loose: OrderedDict, order: OrderedDict, hubbed: OrderedDict, heads: OrderedDict,
          p: float, q: float, threshold: float, hub_off: float, head_off: float,
          own, held: set, can_evict: Callable[[bytes], bool] | None) -> list[bytes]:
    """Up to n victims that may go. While the hub branch order holds more
    than q blocks, its oldest go first, as many as it is over; then the
    rest's pick (merge_rest) gives the others."""
    over = len(hubbed) - int(q)
    if over <= 0:
        return merge_rest(n, loose, order, hubbed, heads, p, threshold, hub_off, head_off, own, held, can_evict)
    victims: list[bytes] = []
    first = min(n, over)
    for k in hubbed:
        if k not in own and k not in held and (can_evict is None or can_evict(k)):
            victims.append(k)
            if len(victims) == first:
                break
    if len(victims) < n:  # the rest's pick may name these again: ask for that many more
        taken = set(victims)
        more = merge_rest(n, loose, order, hubbed, heads, p, threshold, hub_off, head_off, own, held, can_evict)
        victims += [k for k in more if k not in taken][:n - len(victims)]
    return victims


def merge_rest(n: int, loose: OrderedDict, order: OrderedDict, hubbed: OrderedDict, heads: OrderedDict,
               p: float, threshold: float, hub_off: float, head_off: float,
               own, held: set, can_evict: Callable[[bytes], bool] | None) -> list[bytes]:
    """Up to n victims that may go. While the loose order holds more than p
    blocks, its oldest go first (ARC's REPLACE), as many as it is over. Then
    four orders, each walked from its oldest: loose, chain's (stops at its
    first block used at `threshold` or later: shielded), hub branches (last
    use plus hub_off) and hub heads (plus head_off). The oldest head goes
    first; a tie to the lower order, so of one request's blocks stored in one
    step, the new ones (loose, its tail) go before the second uses (the chain order,
    its head)."""
    victims: list[bytes] = []
    take, need = victims.append, n
    walk_loose = iter(loose.items())
    over = len(loose) - int(p)
    if over > 0:
        first = min(n, over)
        for k, _ in walk_loose:
            if k not in own and k not in held and (can_evict is None or can_evict(k)):
                take(k)
                if len(victims) == first:
                    break
        need = n - len(victims)
        if not need:
            return victims
    walks = [walk_loose, iter(order.items()), iter(hubbed.items()), iter(heads.items())]
    offset = (0.0, 0.0, hub_off, head_off)
    at = [next(w, None) for w in walks]
    if at[1] is not None and at[1][1] >= threshold:
        at[1] = None  # the chain order is shielded from its first block
    inf = math.inf
    eff = [inf if a is None else a[1] + o for a, o in zip(at, offset)]  # each walk's next block, shifted
    left = 4 - at.count(None)
    while left > 1 and need:
        i = eff.index(min(eff))  # the oldest of the four
        eff[i] = inf
        bound = min(eff)  # the oldest of the others: walk i leads while older (a tie to the lower order)
        j = eff.index(bound)
        walk, off, k = walks[i], offset[i], at[i][0]
        while True:  # a run of walk i (most picks take one or two runs)
            if k not in own and k not in held and (can_evict is None or can_evict(k)):
                take(k)
                need -= 1
                if not need:
                    return victims
            nxt = next(walk, None)
            if nxt is None or (i == 1 and nxt[1] >= threshold):
                at[i] = None  # walked out (or the chain order reached its shielded part)
                left -= 1
                break
            e = nxt[1] + off
            if e < bound or (e == bound and i < j):
                k = nxt[0]
                continue
            at[i], eff[i] = nxt, e
            break
    if left == 1 and need:  # one order left (the common case): a plain walk
        i = next(j for j in range(4) if at[j] is not None)
        for k, last in chain((at[i],), walks[i]):
            if i == 1 and last >= threshold:
                break
            if k not in own and k not in held and (can_evict is None or can_evict(k)):
                take(k)
                need -= 1
                if not need:
                    break
    return victims


def prefix_end(positions: dict, first_key: bytes, orders: tuple) -> tuple[int | None, bytes | None]:
    """(last use, key) of the deepest resident block (in one of `orders`,
    not stored cold: last use >= 0) at a position before first_key's;
    (None, None) if none or first_key has no position. From the deep end:
    positions are set in prefix order (vLLM's connector, the replay), so the
    first resident key met below the store is the deepest. That is assumed,
    not checked: positions met out of order on the way fall back to the full
    walk, others are not seen."""
    first = positions.get(first_key)
    if first is None:
        return None, None
    above = None
    for k, p in reversed(positions.items()):
        if above is not None and p >= above:
            break
        above = p
        if p < first:
            for order in orders:
                last = order.get(k)
                if last is not None:
                    if last >= 0:
                        return last, k
                    break
    else:
        return None, None
    best, prev, parent = -1, None, None
    for k, p in positions.items():
        if best < p < first:
            for order in orders:
                last = order.get(k)
                if last is not None:
                    if last >= 0:
                        best, prev, parent = p, last, k
                    break
    return prev, parent


# ---- the learning: sampled reuse distances and the shadow LRU --------------

_MAX_SAMPLE = 8  # a sample takes 1 in 2**k keys by one hash byte, k <= 8
SAMPLE_TABLES = [bytes(int(b % (1 << k) == 0) for b in range(256)) for k in range(_MAX_SAMPLE + 1)]  # 1 in 2**k
_HASH_BYTE = itemgetter(-5)  # a key's last hash byte (4 group bytes follow)


def hash_bytes(keys: list[bytes]) -> bytes:
    """Each key's hash byte (key[-5]): sliced from one joined buffer where
    all keys have one length (vLLM's keys do; a mixed batch whose lengths
    happen to add up samples other bytes, which only moves the sample), else
    read key by key."""
    if not keys:
        return b""
    size = len(keys[0])
    joined = b"".join(keys)
    if len(joined) == size * len(keys):
        return joined[size - 5::size]
    return bytes(map(_HASH_BYTE, keys))


def shadow(sim: OrderedDict, keys: list[bytes], hit: bool, cap: int, counting: bool) -> tuple[int, int]:
    """A use of the shadow LRU's keys (all hits or all misses): while
    counting, those this cache hit and the shadow missed (`ours`) or the
    other way round (`lru`); then they become its newest, the head newest of
    all, and its oldest go beyond `cap` keys. Returns (ours, lru)."""
    ours = lru = 0
    if counting:
        found = sum(map(sim.__contains__, keys))
        if hit:
            ours = len(keys) - found
        else:
            lru = found
    deque(map(sim.pop, keys, repeat(None)), 0)
    for k in reversed(keys):
        sim[k] = None
    over = len(sim) - cap
    if over > 0:
        deque(map(sim.popitem, repeat(False, over)), 0)
    return ours, lru


_python_shadow = shadow  # (follow's own: `shadow` below may become the C twin's)


def follow(keys: list[bytes], cls: int, hit: bool, now: int, low: int, k: int, s: int, episodes: dict,
           live: list[int], dist: tuple[list[float], list[float]], met: list[float], sim: OrderedDict,
           sim_cap: int, counting: bool, bin_of: bytes) -> tuple[int, int, int]:
    """A use of keys (all hits, or all stored after a miss) by class cls at
    clock `now`, for the learning. The shadow LRU sees the keys its sample
    (1 in 2**s) takes. Each key in the sample of the lowest live rate (1 in
    2**low; the samples nest, so every followed key is in it) ends the
    episode it was followed in: a reuse at distance d = now - its start,
    added to its class's histogram dist[c] and to `met` (hits or misses) at
    bin_of[d] (the last bin beyond the table), weighted 2**rate. Keys in
    class cls's sample (1 in 2**k) start an episode: episodes[key] = (now <<
    8) | (k << 1) | cls. live[rate] counts live episodes per rate.
    Returns (started, ours, lru): the weight of the episodes started (a key
    twice in one call starts one) and the shadow's counts (`shadow`)."""
    hashed = hash_bytes(keys) if k or s else None
    ours = lru = 0
    if not s:
        if keys:
            ours, lru = _python_shadow(sim, keys, hit, sim_cap, counting)
    else:
        picked = hashed.translate(SAMPLE_TABLES[s])
        if 1 in picked:
            ours, lru = _python_shadow(sim, list(compress(keys, picked)), hit, sim_cap, counting)
    if low:
        sampled = hashed.translate(SAMPLE_TABLES[low])
        if 1 not in sampled:  # (most calls: none followed, so none starts either)
            return 0, ours, lru
        cand = list(compress(keys, sampled))
    else:
        cand = keys
    ended = list(map(episodes.pop, cand, repeat(None)))
    new = cand if k == low else list(compress(keys, hashed.translate(SAMPLE_TABLES[k])))
    started = 0
    if new:
        before = len(episodes)
        episodes.update(zip(new, repeat((now << 8) | (k << 1) | cls)))
        added = len(episodes) - before
        started = added << k
        live[k] += added
    if ended.count(None) < len(ended):  # (C-level: most calls end no episode)
        last = len(bin_of) - 1
        for e in ended:  # (start << 8) | (rate exponent << 1) | class
            if e is not None:
                d = now - (e >> 8)
                ek = (e >> 1) & 127
                live[ek] -= 1
                b = bin_of[d if d < last else last]
                w = float(1 << ek)
                dist[e & 1][b] += w
                met[b] += w
    return started, ours, lru


PYTHON = {name: globals()[name] for name in ("stamp", "renew", "renew_all", "touch", "drop", "merge", "prefix_end",
                                               "shadow", "follow")}

try:  # the C twin (_hubchain_loops*.c), built at install by setup.py; optional
    from kvoffload.policies.hubchain import _hubchain_loops as native
except ImportError:  # (no compiler at install: the loops above)
    native = None

NATIVE = native is not None and os.environ.get("KVOFFLOAD_NATIVE_LOOPS", "1") != "0"
if NATIVE:
    stamp, renew, renew_all, touch, drop, merge, shadow = (  # noqa: F811
        native.stamp, native.renew, native.renew_all, native.touch, native.drop, native.merge, native.shadow)

    def follow(*args):  # noqa: F811
        # (the C twin takes keys of one length, bytes, 5 or more; others: the Python)
        r = native.follow(*args)
        return PYTHON["follow"](*args) if r is NotImplemented else r

    def prefix_end(positions, first_key, orders):  # noqa: F811
        # (the C twin takes a dict of int positions and int last uses; others: the Python)
        r = native.prefix_end(positions, first_key, orders)
        return PYTHON["prefix_end"](positions, first_key, orders) if r is NotImplemented else r
