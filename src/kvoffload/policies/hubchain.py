"""`segchain` that lets branches off a hub age faster ("hubchain").

A hub is a block that many requests branch from: a shared system prompt, a
few-shot preamble, a tool schema. A request whose resident prefix ends at a
hub starts a new branch there (a first turn, a one-shot prompt). On some
workloads most such branches are never read again (Mooncake: 61% of
conversations end after one turn; one-shot prompts after a preamble), and
ARC wins there by evicting blocks used once before blocks used again. On
others (chats, a system prompt with a tail of users) they are read again
soon, and LRU wins. So:

- Hub branches are kept in a third order, beside `segchain`'s chain and loose
  orders (same clock, the request count). For eviction their last use counts
  `shift` older than it is; the oldest of the three heads goes first. With
  shift 0 this is `segchain`, which is LRU where no chain rule fires.
- `shift` adapts like ARC's target, from ghosts (keys recently evicted): a
  re-stored key that left the hub order means hub branches live too short
  (shift down), one that left the other orders means they live too long
  (shift up). One step is the time one stored block stays, so shift moves
  on the same scale as ARC's p. It stays within [0, the cache's lifetime].
- A hub branch block's first hit moves it into the chain order, as a loose
  block's does: it is now a continued conversation.
- A block is a hub once `HUB` requests have branched from it (their stores
  began right after it); the count lives while the block is resident.

Everything else (a store never evicts its own request's keys, a cut store
refuses the rest, the reuse-interval shield, f) is `segchain`'s.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from kvoffload.abstractions import ReqContext
from kvoffload.policies.chain import _Req
from kvoffload.policies.segchain import SegChainPolicy, _SegReq


class _HubReq(_SegReq):
    __slots__ = ("hub",)


class HubChainPolicy(SegChainPolicy):
    name = "hubchain"
    HUB = 8  # branches seen from a block before it counts as a hub

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self._hubbed: OrderedDict[bytes, int] = OrderedDict()  # hub branches' blocks, never hit; oldest first
        self._branches: dict[bytes, int] = {}  # resident key -> requests that branched right after it
        self._ghost_hub: OrderedDict[bytes, None] = OrderedDict()  # evicted from the hub order
        self._ghost_rest: OrderedDict[bytes, None] = OrderedDict()  # evicted from the other two
        self.shift = 0.0  # in requests (the clock's unit)
        self._life = 0.0  # running mean age of victims, in requests: the cache's lifetime

    def _start(self, keys: list[bytes], ctx: ReqContext) -> _Req:
        """segchain's, plus: does the resident prefix end at a hub?"""
        self._clock += 1
        now = self._clock
        positions = ctx.offload_key_positions()
        first = positions.get(keys[0])
        prev = parent = None
        if first is not None:
            order, loose, hubbed = self._order, self._loose, self._hubbed
            best = -1
            for k, p in positions.items():  # the deepest resident block before the store
                if best < p < first:
                    last = order.get(k)
                    if last is None:
                        last = loose.get(k)
                        if last is None:
                            last = hubbed.get(k)
                    if last is not None and last >= 0:
                        best, prev, parent = p, last, k
        if prev is not None:
            gap = now - prev
            self._gap = float(gap)
        else:
            gap = self._gap
        req = _HubReq(now - self.f * gap)
        req.loose = prev is None
        req.hub = False
        if parent is not None:
            n = self._branches.get(parent, 0) + 1
            self._branches[parent] = n
            req.hub = n >= self.HUB
        return req

    def _pick(self, n: int, can_evict: Callable[[bytes], bool]) -> list[bytes]:
        hubbed = self._hubbed
        if not hubbed:
            return super()._pick(n, can_evict)
        # Three orders: chain's (stops at its first shielded block), loose,
        # and the hub branches', whose last use counts `shift` older.
        threshold, own, shift = self._threshold, self._own or (), self.shift
        victims: list[bytes] = []
        main, loose, hub = iter(self._order.items()), iter(self._loose.items()), iter(hubbed.items())
        m, lo, h = next(main, None), next(loose, None), next(hub, None)
        while len(victims) < n:
            if m is not None and m[1] >= threshold:
                m = None
            best = None
            if m is not None:
                best, age = 0, m[1]
            if lo is not None and (best is None or lo[1] < age):
                best, age = 1, lo[1]
            if h is not None and (best is None or h[1] - shift < age):
                best = 2
            if best is None:
                break
            if best == 0:
                k = m[0]
                m = next(main, None)
            elif best == 1:
                k = lo[0]
                lo = next(loose, None)
            else:
                k = h[0]
                h = next(hub, None)
            if k not in own and can_evict(k):
                victims.append(k)
        return victims

    # ---- the EvictionPolicy contract -------------------------------------

    def insert(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        req = ctx.get_owned(self) if ctx is not None else None
        if req is None or not req.loose and not req.hub:
            dest = self._order
        else:
            dest = self._loose if req.loose else self._hubbed
        gh, gr = self._ghost_hub, self._ghost_rest
        if gh or gr:
            self._adapt(keys, gh, gr)
        now = self._clock
        for k in reversed(keys):  # the tail lands older than the head
            dest[k] = now

    def _adapt(self, keys: list[bytes], gh: OrderedDict, gr: OrderedDict) -> None:
        """ARC's rule on shift: a ghost of the hub order re-stored says hub
        branches live too short, one of the others says too long."""
        if gh.keys().isdisjoint(keys) and gr.keys().isdisjoint(keys):
            return
        step = self._life / self.capacity  # one block's stay, in requests
        shift = self.shift
        for k in keys:
            if k in gh:
                del gh[k]
                shift -= step * max(1.0, len(gr) / max(1, len(gh)))
            elif k in gr:
                del gr[k]
                shift += step * max(1.0, len(gh) / max(1, len(gr)))
        self.shift = min(max(shift, 0.0), self._life)

    def touch(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        hubbed = self._hubbed
        if hubbed:
            order, now = self._order, self._clock
            for k in keys:
                if k in hubbed:  # its first hit: a continued branch, chain's from now on
                    del hubbed[k]
                    order[k] = now
        super().touch(keys, ctx)

    def refresh(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        super().refresh(keys, ctx)
        hubbed, now = self._hubbed, self._clock
        move = hubbed.move_to_end
        for k in reversed(keys):
            if k in hubbed:
                hubbed[k] = now
                move(k)

    def remove(self, key: bytes) -> None:
        super().remove(key)
        self._hubbed.pop(key, None)
        self._branches.pop(key, None)

    def evict(self, n: int, can_evict: Callable[[bytes], bool]) -> list[bytes] | None:
        if n <= 0:
            return []
        order, loose, hubbed = self._order, self._loose, self._hubbed
        if n > len(order) + len(loose) + len(hubbed):
            return None
        victims = self._pick(n, can_evict)
        if len(victims) < n:
            return None  # nothing changed
        self._threshold, self._own = float("inf"), None  # set by admit for one store only
        ghost, gh, gr, branches = self._evicted, self._ghost_hub, self._ghost_rest, self._branches
        now, age = self._clock, 0
        for k in victims:
            last = order.pop(k, None)
            if last is None:
                last = loose.pop(k, None)
                if last is None:
                    last = hubbed.pop(k)
                    gh[k] = None
                else:
                    gr[k] = None
            else:
                gr[k] = None
            ghost[k] = None
            branches.pop(k, None)
            age += now - last if last >= 0 else 0
        self._life += (age / n - self._life) * min(1.0, n / self.capacity)
        c = self.capacity
        for g in (ghost, gh, gr):
            while len(g) > c:
                g.popitem(last=False)
        return victims

    def __len__(self) -> int:
        return len(self._order) + len(self._loose) + len(self._hubbed)

    def __contains__(self, key: object) -> bool:
        return key in self._order or key in self._loose or key in self._hubbed
