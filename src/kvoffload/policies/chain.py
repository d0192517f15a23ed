"""Prefix-chain policy: LRU that keeps resident prefixes whole.

A prefix cache serves a block only if every block before it on the request
is served too, so storing a deep block by evicting the head of a prefix
that will be read again is pure loss (LRU's loop pathology on agentic
traces: every turn re-reads a context larger than the cache, stores its
tail over its head, and the next turn misses at block 0). Three rules on
top of LRU order (oldest first, a request's tail before its head):

1. A store never evicts keys of its own request (the head it just read):
   when nothing else may go, the rest of the store is refused, and so is
   everything that request offers later (a block after a hole is useless).
2. Protection by reuse interval: a request whose prefix was last used g
   requests ago may evict only keys idle for longer than f*g (a
   conversation's blocks are worth keeping while it comes back at its own
   pace; evicting a chain used since is evicting something needed sooner).
   A request with no resident prefix (a new chain) uses the interval seen
   most recently on a continuing chain.
3. f adapts (LeCaR/ARC-style regret, from ghosts of what each side gave
   up): a refused key that later turns out to be the first miss of a
   request lowers f (towards plain LRU, f = 0); an evicted key that turns
   out to be the first miss raises it. Only the first miss counts: a
   deeper block is worth nothing once a block before it is gone.

Bookkeeping: an OrderedDict key -> clock of its last use (the clock counts
requests), two bounded ghost dicts, and per request one small record on its
ReqContext. Uses only what the manager sees (key positions on the request,
prefix order, history); nothing of the future.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from kvoffload.abstractions import ReqContext
from kvoffload.policies.base import EvictionPolicy

F_MAX = 4.0
F_STEP = 0.05
_COLD = -1  # clock of keys stored with kv_retention "low": before every other key


class _Req:
    """Per-request state: the eviction threshold and whether a store was cut."""

    __slots__ = ("threshold", "cut", "seen")

    def __init__(self, threshold: float):
        self.threshold = threshold
        self.cut = False
        self.seen = False  # its first new key was checked against the ghosts


class ChainPolicy(EvictionPolicy):
    name = "chain"
    f_max = F_MAX

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self._order: OrderedDict[bytes, int] = OrderedDict()  # key -> clock of last use, oldest first
        self._clock = 0
        self._gap = 0.0  # the last reuse interval seen on a continuing chain
        self.f = 1.0
        self._refused: OrderedDict[bytes, None] = OrderedDict()  # ghosts, bounded by capacity
        self._evicted: OrderedDict[bytes, None] = OrderedDict()
        self._threshold = float("inf")  # of the store being prepared (admit -> evict)
        self._own: dict | None = None  # its request's key positions: never its victims

    # ---- admission (the manager calls it before making room) ---------------

    def admit(self, keys: list[bytes], free: int, ctx: ReqContext | None,
              can_evict: Callable[[bytes], bool]) -> int:
        """How many of `keys` (new, prefix order) to store: a head of them."""
        if ctx is None:
            self._threshold, self._own = float("inf"), None
            return len(keys)
        req = ctx.get_owned(self)
        if req is None:
            req = self._start(keys, ctx)
            ctx.set_owned(self, req)
        if req.cut:
            return 0
        if not req.seen:
            req.seen = True
            self._learn(keys[0])
        self._threshold, self._own = req.threshold, ctx.offload_key_positions()
        need = len(keys) - free
        if need <= 0:
            return len(keys)
        n = self._count_victims(need, can_evict)
        if n < need:
            req.cut = True
            refused = keys[free + n:]
            ghost = self._refused
            for k in refused:
                ghost[k] = None
            while len(ghost) > self.capacity:
                ghost.popitem(last=False)
            return free + n
        return len(keys)

    def _start(self, keys: list[bytes], ctx: ReqContext) -> _Req:
        """A request's first store: its prefix's last use sets its threshold."""
        self._clock += 1
        now = self._clock
        positions = ctx.offload_key_positions()
        first = positions.get(keys[0])
        prev = None
        if first is not None:
            order = self._order
            best = -1
            for k, p in positions.items():  # the deepest resident block before the store
                if best < p < first:
                    last = order.get(k)
                    if last is not None and last >= 0:
                        best, prev = p, last
        if prev is not None:
            gap = now - prev
            self._gap = float(gap)
        else:
            gap = self._gap
        return _Req(now - self.f * gap)

    def _learn(self, first_miss: bytes) -> None:
        if first_miss in self._refused:  # refusing it cost this hit
            del self._refused[first_miss]
            self.f = max(0.0, self.f - F_STEP)
        elif first_miss in self._evicted:  # evicting it cost this hit
            del self._evicted[first_miss]
            self.f = min(self.f_max, self.f + F_STEP)

    def _count_victims(self, need: int, can_evict: Callable[[bytes], bool]) -> int:
        threshold, own = self._threshold, self._own or ()
        n = 0
        for k, last in self._order.items():
            if last >= threshold:
                break
            if k not in own and can_evict(k):
                n += 1
                if n == need:
                    break
        return n

    # ---- the EvictionPolicy contract -------------------------------------

    def insert(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        order, now = self._order, self._clock
        for k in reversed(keys):  # the tail lands older than the head
            order[k] = now

    def insert_cold(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        order = self._order
        move = order.move_to_end
        for k in keys:  # head first to the old end: the tail ends up oldest
            order[k] = _COLD
            move(k, last=False)

    def touch(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        self._rank(keys, ctx)

    def refresh(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        self._rank(keys, ctx)

    def _rank(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        req = ctx.get_owned(self) if ctx is not None else None
        if req is None:
            self._clock += 1
        now = self._clock
        order = self._order
        move = order.move_to_end
        for k in reversed(keys):
            if k in order:
                order[k] = now
                move(k)

    def remove(self, key: bytes) -> None:
        self._order.pop(key, None)

    def evict(self, n: int, can_evict: Callable[[bytes], bool]) -> list[bytes] | None:
        if n <= 0:
            return []
        order = self._order
        if n > len(order):
            return None
        threshold, own = self._threshold, self._own or ()
        victims: list[bytes] = []
        for k, last in order.items():
            if last >= threshold:
                break
            if k not in own and can_evict(k):
                victims.append(k)
                if len(victims) == n:
                    break
        if len(victims) < n:
            return None  # nothing changed
        self._threshold, self._own = float("inf"), None  # set by admit for one store only
        ghost = self._evicted
        for k in victims:
            del order[k]
            ghost[k] = None
        while len(ghost) > self.capacity:
            ghost.popitem(last=False)
        return victims

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order
