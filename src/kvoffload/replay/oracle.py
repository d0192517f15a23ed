"""Offline simulators of a prefix cache of fixed capacity (in blocks).

Both follow the trace README's request semantics: at arrival a request
looks up all its blocks and gains the leading run of resident ones (what a
prefix cache can reuse); then its blocks are touched or inserted. They are
the yardsticks printed beside the replay: `lru` is what the replay with an
LRU policy and no GPU cache must match, `belady` (evict the block whose next
use is farthest away; never admit a block needed later than every resident
one) is the best any policy can do.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

ORACLES = ("lru", "belady")


@dataclass
class OracleResult:
    policy: str
    capacity: int
    block_refs: int
    prefix_hits: int

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.block_refs if self.block_refs else 0.0


def simulate(requests: Sequence[Sequence[int]], capacity: int, policy: str) -> OracleResult:
    if policy == "lru":
        return simulate_lru(requests, capacity)
    if policy == "belady":
        return simulate_belady(requests, capacity)
    raise ValueError(f"unknown oracle {policy!r}; known: {', '.join(ORACLES)}")


def leading_run(blocks: Sequence[int], resident) -> int:
    n = 0
    for b in blocks:
        if b not in resident:
            break
        n += 1
    return n


def simulate_lru(requests: Sequence[Sequence[int]], capacity: int) -> OracleResult:
    """LRU the way the replay drives a manager: touch the resident blocks,
    store the blocks past the leading hits (evicting least recent, but never
    the blocks this store names; refused whole if that leaves too few), rank
    them head first, then touch the reused leading run again: a request's
    blocks end most recent head first, so a prefix's tail goes first.
    Stored blocks are not touched again: that would be a second use."""
    cache: OrderedDict[int, None] = OrderedDict()  # least recent first
    hits = refs = 0
    for blocks in requests:
        refs += len(blocks)
        n = leading_run(blocks, cache)
        hits += n
        for b in reversed(blocks):
            if b in cache:
                cache.move_to_end(b)
        offered = blocks[n:]
        missing = list(dict.fromkeys(b for b in offered if b not in cache))
        need = len(cache) + len(missing) - capacity
        if need > 0:
            protected = set(offered)
            victims = []
            for b in cache:
                if b not in protected:
                    victims.append(b)
                    if len(victims) == need:
                        break
            if len(victims) < need:  # the store is refused: nothing changes
                offered = []
            else:
                for b in victims:
                    del cache[b]
        # the store ranks what it writes (the missing blocks) head first; a
        # block it names that is already held keeps the rank the request's
        # touch gave it (a store is not a use); then the reused prefix is
        # touched again
        for b in reversed(offered):
            if b not in cache:
                cache[b] = None
        for b in reversed(blocks[:n]):
            if b in cache:  # the store may have evicted a reused block
                cache.move_to_end(b)
    return OracleResult("lru", capacity, refs, hits)


def simulate_belady(requests: Sequence[Sequence[int]], capacity: int,
                    decode: Sequence[Sequence[int]] | None = None) -> OracleResult:
    """Belady over the prompts; `decode` (one list per request) are blocks a
    request stores after its prompt without looking them up."""
    decode = decode or [()] * len(requests)
    flat = [b for blocks, more in zip(requests, decode) for b in (*blocks, *more)]
    never = len(flat) + 1
    next_use = [never] * len(flat)
    last: dict[int, int] = {}
    for i in range(len(flat) - 1, -1, -1):
        next_use[i] = last.get(flat[i], never)
        last[flat[i]] = i
    resident: dict[int, int] = {}  # block -> position of its next use
    heap: list[tuple[int, int]] = []  # (-next use, block), stale entries skipped
    hits = 0
    pos = 0
    for blocks, more in zip(requests, decode):
        hits += leading_run(blocks, resident)
        for b in (*blocks, *more):
            nxt = next_use[pos]
            pos += 1
            if b in resident:
                resident[b] = nxt
                heapq.heappush(heap, (-nxt, b))
                continue
            if nxt == never:
                continue  # never used again: not worth a slot
            while len(resident) >= capacity:
                far, victim = heapq.heappop(heap)
                if resident.get(victim) != -far:
                    continue  # stale entry
                if -far < nxt:  # every resident block is needed sooner: bypass
                    heapq.heappush(heap, (far, victim))
                    break
                del resident[victim]
            if len(resident) < capacity:
                resident[b] = nxt
                heapq.heappush(heap, (-nxt, b))
    return OracleResult("belady", capacity, sum(len(b) for b in requests), hits)


def replay_oracles(requests: Sequence[Sequence[int]], tiers: dict, fallback_capacity: int) -> dict:
    """The yardsticks printed beside a replay: LRU and Belady at the first
    (CPU) tier's capacity and, when there are lower tiers of known capacity,
    also at all tiers' capacity together (one cache as large as the tiers:
    what a tiered run should be held to, an upper bound for any hierarchy).
    "per_tier": for each tier, Belady at the capacity of that tier and the
    tiers above it together (what the tiers down to it could serve at best:
    the headroom the report shows); it stops at a tier of unknown size."""
    leaves = {n: t for n, t in tiers.items() if not t.get("composite")}
    caps = [t["gauges"].get("capacity_blocks") for t in leaves.values()]
    cap = int(caps[0] if caps and caps[0] else fallback_capacity)
    belady: dict[int, float] = {}

    def opt(c: int) -> float:
        if c not in belady:
            belady[c] = simulate(requests, c, "belady").hit_rate
        return belady[c]

    out: dict = {"capacity_blocks": cap, "lru": simulate(requests, cap, "lru").hit_rate, "belady": opt(cap)}
    if len(leaves) > 1 and all(caps):
        total = int(sum(caps))
        out.update(all_tiers_capacity_blocks=total, all_tiers_lru=simulate(requests, total, "lru").hit_rate,
                   all_tiers_belady=opt(total))
    per_tier, total = {}, 0
    for i, (name, c) in enumerate(zip(leaves, caps)):
        c = c or (cap if i == 0 else None)
        if not c:
            break
        total += int(c)
        per_tier[name] = {"capacity_blocks": total, "belady": opt(total)}
    out["per_tier"] = per_tier
    return out
