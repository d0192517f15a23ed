"""`chain` with unshielded loose blocks: scan resistance for the prefix-chain policy.

`chain` shields every block idle for less than f x the storing request's
reuse interval. Right after a long scan (or among one-shot prompts) that
shields fresh blocks that were used once: a conversation coming back may
not evict them, and its own new blocks are refused. Here the blocks stored
by a request with no resident prefix (a new chain: a scan, a one-shot
prompt, a first turn) are loose until their first hit: they are kept in LRU
order beside chain's blocks, and eviction takes the older of the two heads,
but a loose block is never shielded. A hit moves it to chain's order, where
the shield holds. Everything else is `chain`'s (a store never evicts its own
request's keys, a cut store refuses the rest, f adapts from ghosts).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from itertools import chain

from kvoffload.abstractions import ReqContext
from kvoffload.policies.chain import _COLD, ChainPolicy, _Req
from kvoffload.policies.hubchain_loops import prefix_end


class _SegReq(_Req):
    __slots__ = ("loose",)


class SegChainPolicy(ChainPolicy):
    name = "segchain"
    # f stays <= 1: a request shields at most its own reuse interval. Above
    # that, blocks a scan evicted from returning conversations raised f until
    # their new blocks were refused (scan-tune at 10%: -0.015 against LRU).
    f_max = 1.0

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self._loose: OrderedDict[bytes, int] = OrderedDict()  # new chains' blocks, never hit; oldest first
        self._picked: tuple | None = None  # (can_evict, victims) admit counted, for the evict that follows

    def _start(self, keys: list[bytes], ctx: ReqContext) -> _Req:
        """As chain's, the last use of a resident block looked up in every
        order; a request without a resident prefix stores loose blocks."""
        self._clock += 1
        now = self._clock
        prev, parent = self._prefix_end(keys, ctx)
        if prev is not None:
            gap = now - prev
            self._gap = float(gap)
        else:
            gap = self._gap
        req = self._new_req(now - self.f * gap)
        req.loose = prev is None
        self._branched(req, parent)
        return req

    def _prefix_end(self, keys: list[bytes], ctx: ReqContext) -> tuple[int | None, bytes | None]:
        """(last use, key) of the deepest resident block before the store
        (hubchain_loops.prefix_end: from the deep end, positions assumed in
        prefix order; C where built)."""
        return prefix_end(ctx.offload_key_positions(), keys[0], self._orders())

    def _orders(self) -> tuple[OrderedDict, ...]:
        """The orders a resident key is in (key -> last use)."""
        return self._order, self._loose

    def _new_req(self, threshold: float) -> _SegReq:
        return _SegReq(threshold)

    def _branched(self, req: _SegReq, parent: bytes | None) -> None:
        """The request's store begins right after `parent` (None: no resident prefix)."""

    def _pick(self, n: int, can_evict: Callable[[bytes], bool]) -> list[bytes]:
        """Up to n victims: the older head of the two orders first; chain's
        order stops at the first shielded block, the loose one never."""
        threshold, own = self._threshold, self._own or ()
        victims: list[bytes] = []
        main, loose = iter(self._order.items()), iter(self._loose.items())
        m, lo = next(main, None), next(loose, None)
        while len(victims) < n:
            if m is not None and m[1] >= threshold:
                m = None  # the rest of chain's order is shielded
            if m is None or lo is None:
                break
            if lo[1] < m[1]:
                k = lo[0]
                lo = next(loose, None)
            else:
                k = m[0]
                m = next(main, None)
            if k not in own and can_evict(k):
                victims.append(k)
        # one order left: a plain walk (the common case, e.g. no loose blocks)
        if lo is not None and len(victims) < n:
            for k, _ in chain((lo,), loose):
                if k not in own and can_evict(k):
                    victims.append(k)
                    if len(victims) == n:
                        break
        elif m is not None and len(victims) < n:
            for k, last in chain((m,), main):
                if last >= threshold:
                    break
                if k not in own and can_evict(k):
                    victims.append(k)
                    if len(victims) == n:
                        break
        return victims

    def _count_victims(self, need: int, can_evict: Callable[[bytes], bool]) -> int:
        # The manager's evict follows at once, for at most this many: it takes
        # a head of these (a walk for fewer victims stops earlier on the same path).
        victims = self._pick(need, can_evict)
        self._picked = (can_evict, victims)
        return len(victims)

    # ---- the EvictionPolicy contract -------------------------------------

    def insert(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        self._picked = None  # any change: admit's count is stale
        req = ctx.get_owned(self) if ctx is not None else None
        dest = self._loose if req is not None and req.loose else self._order
        now = self._clock
        for k in reversed(keys):  # the tail lands older than the head
            dest[k] = now

    def insert_cold(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        self._picked = None  # any change: admit's count is stale
        loose = self._loose
        move = loose.move_to_end
        for k in keys:  # head first to the old end: the tail ends up oldest
            loose[k] = _COLD
            move(k, last=False)

    def touch(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        self._picked = None  # any change: admit's count is stale
        now = self._tick(ctx)
        order, loose = self._order, self._loose
        move = order.move_to_end
        for k in reversed(keys):
            if k in order:
                order[k] = now
                move(k)
            elif k in loose:  # its first hit: shielded from now on
                del loose[k]
                order[k] = now

    def refresh(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        self._picked = None  # any change: admit's count is stale
        now = self._tick(ctx)
        for seg in (self._order, self._loose):
            move = seg.move_to_end
            for k in reversed(keys):
                if k in seg:
                    seg[k] = now
                    move(k)

    def _tick(self, ctx: ReqContext | None) -> int:
        if ctx is None or ctx.get_owned(self) is None:
            self._clock += 1
        return self._clock

    def remove(self, key: bytes) -> None:
        self._picked = None  # any change: admit's count is stale
        self._order.pop(key, None)
        self._loose.pop(key, None)

    def evict(self, n: int, can_evict: Callable[[bytes], bool]) -> list[bytes] | None:
        if n <= 0:
            return []
        victims = self._victims(n, can_evict)
        if victims is None or len(victims) < n:
            return None  # nothing changed
        self._threshold, self._own = float("inf"), None  # set by admit for one store only
        self._drop(victims)
        ghost = self._evicted
        while len(ghost) > self.capacity:
            ghost.popitem(last=False)
        return victims

    def _victims(self, n: int, can_evict: Callable[[bytes], bool]) -> list[bytes] | None:
        picked, self._picked = self._picked, None
        if n > len(self):
            return None
        if picked is not None and picked[0] is can_evict and len(picked[1]) >= n:
            return picked[1][:n]
        return self._pick(n, can_evict)

    def _drop(self, victims: list[bytes]) -> None:
        """Stop tracking the victims; each becomes a ghost."""
        order, loose, ghost = self._order, self._loose, self._evicted
        for k in victims:
            if order.pop(k, None) is None:
                del loose[k]
            ghost[k] = None

    def __len__(self) -> int:
        return len(self._order) + len(self._loose)

    def __contains__(self, key: object) -> bool:
        return key in self._order or key in self._loose
