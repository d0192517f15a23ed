"""Segmented prefix-chain policy: `chain`'s rules on a two-segment LRU.

`chain` protects by recency alone, so right after a scan or among one-shot
prompts the fresh blocks used once are shielded, and it has no frequency
signal (where ARC wins on the Mooncake trace). Here stored blocks enter a
probation segment P; a hit (touch) moves a block to the main segment M.
A store evicts, in this order:

1. the oldest blocks of P while P is above its target size, without the
   reuse-interval shield (a block never hit earns no protection: scan and
   one-shot resistance, the frequency signal of ARC's T1/T2);
2. then `chain`'s way from M (oldest first, only blocks idle longer than
   f x the request's reuse interval), then from P the same way.

Rule 1 of `chain` holds everywhere: a store never evicts its own request's
keys, and a cut store refuses the rest of its request. The target size of P
adapts, like ARC's p but from one lookup per request: a request's first
miss found among the ghosts of P-evictions raises it, one among the ghosts
of M-evictions lowers it (only the first miss counts, as for `f`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from kvoffload.abstractions import ReqContext
from kvoffload.policies.chain import _COLD, F_MAX, F_STEP, ChainPolicy, _Req

import os
P_START = float(os.environ.get("SEG_START", "0.5"))  # target size of P, as a fraction of capacity
P_STEP = float(os.environ.get("SEG_STEP", str(1 / 32)))  # its step per first miss found among the ghosts


class SegChainPolicy(ChainPolicy):
    name = "segchain"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self._prob: OrderedDict[bytes, int] = OrderedDict()  # stored, never hit since; oldest first
        self.target = P_START * capacity
        self._step = max(1.0, P_STEP * capacity)
        self._evicted_p: OrderedDict[bytes, None] = OrderedDict()  # ghosts of rule-1 (P) evictions

    def _learn(self, first_miss: bytes) -> None:
        if first_miss in self._refused:
            del self._refused[first_miss]
            self.f = max(0.0, self.f - F_STEP)
        elif first_miss in self._evicted_p:  # P was too small for it
            del self._evicted_p[first_miss]
            self.target = min(float(self.capacity), self.target + self._step)
        elif first_miss in self._evicted:  # M lost it under the shield, or P too large
            del self._evicted[first_miss]
            self.f = min(F_MAX, self.f + F_STEP)
            self.target = max(0.0, self.target - self._step)

    def _pick(self, n: int, can_evict: Callable[[bytes], bool]) -> tuple[list[bytes], int]:
        """Up to n victims, in eviction order; the first `loose` came from P
        above its target."""
        threshold, own = self._threshold, self._own or ()
        prob = self._prob
        victims: list[bytes] = []
        over = len(prob) - int(self.target)
        if over > 0:
            for k in prob:
                if len(victims) >= over or len(victims) == n:
                    break
                if k not in own and can_evict(k):
                    victims.append(k)
        loose = len(victims)
        taken = set(victims) if loose else ()
        for seg in (self._order, prob):
            if len(victims) == n:
                break
            for k, last in seg.items():
                if last >= threshold:
                    break
                if k not in own and can_evict(k) and k not in taken:
                    victims.append(k)
                    if len(victims) == n:
                        break
        return victims, loose

    def _start(self, keys: list[bytes], ctx: ReqContext) -> _Req:
        """As chain's, with a resident block's last use looked up in both segments."""
        self._clock += 1
        now = self._clock
        positions = ctx._offload_key_positions
        first = positions.get(keys[0])
        prev = None
        if first is not None:
            order, prob = self._order, self._prob
            best = -1
            for k, p in positions.items():  # the deepest resident block before the store
                if best < p < first:
                    last = order.get(k)
                    if last is None:
                        last = prob.get(k)
                    if last is not None and last >= 0:
                        best, prev = p, last
        if prev is not None:
            gap = now - prev
            self._gap = float(gap)
        else:
            gap = self._gap
        return _Req(now - self.f * gap)

    def _count_victims(self, need: int, can_evict: Callable[[bytes], bool]) -> int:
        return len(self._pick(need, can_evict)[0])

    # ---- the EvictionPolicy contract -------------------------------------

    def insert(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        prob, now = self._prob, self._clock
        for k in reversed(keys):  # the tail lands older than the head
            prob[k] = now

    def insert_cold(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        prob = self._prob
        move = prob.move_to_end
        for k in keys:
            prob[k] = _COLD
            move(k, last=False)

    def touch(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        now = self._tick(ctx)
        order, prob = self._order, self._prob
        move = order.move_to_end
        for k in reversed(keys):
            if k in order:
                order[k] = now
                move(k)
            elif k in prob:  # its first hit: promoted
                del prob[k]
                order[k] = now

    def refresh(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        now = self._tick(ctx)
        for seg in (self._order, self._prob):
            move = seg.move_to_end
            for k in reversed(keys):
                if k in seg:
                    seg[k] = now
                    move(k)

    def _tick(self, ctx: ReqContext | None) -> int:
        if ctx is None or ctx._state.get(self) is None:
            self._clock += 1
        return self._clock

    def remove(self, key: bytes) -> None:
        self._order.pop(key, None)
        self._prob.pop(key, None)

    def evict(self, n: int, can_evict: Callable[[bytes], bool]) -> list[bytes] | None:
        if n <= 0:
            return []
        if n > len(self._order) + len(self._prob):
            return None
        victims, loose = self._pick(n, can_evict)
        if len(victims) < n:
            return None  # nothing changed
        self._threshold, self._own = float("inf"), None  # set by admit for one store only
        order, prob = self._order, self._prob
        for i, k in enumerate(victims):
            if k in prob:
                del prob[k]
                ghost = self._evicted_p if i < loose else self._evicted
            else:
                del order[k]
                ghost = self._evicted
            ghost[k] = None
        for ghost in (self._evicted, self._evicted_p):
            while len(ghost) > self.capacity:
                ghost.popitem(last=False)
        return victims

    def __len__(self) -> int:
        return len(self._order) + len(self._prob)

    def __contains__(self, key: object) -> bool:
        return key in self._order or key in self._prob
