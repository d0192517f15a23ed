"""`hubchain`, the default eviction policy: a prefix chain (chain.py) in
four orders, with ARC's frequency split and a learned age shift for blocks
that branch off a hub.

A hub is a block many requests branch from: a shared system prompt, a
few-shot preamble, a tool schema. Blocks stored right after it (a first
turn, a one-shot prompt) are often never read again, and there ARC beats
LRU; in chats they are read again soon, and LRU wins. The rules:

- A block is a hub once HUB requests have branched right after it (their
  stores began there); the count lives while the block is resident.
- Four orders, each oldest first on one clock (requests): loose (stored,
  not hit yet), chain (hit at least once), hub branches (stored by a
  request branching off a hub, not hit yet) and hub heads (the blocks a
  hub branch request hit: the prompt up to the hub).
- A victim is the oldest head of the four orders: a hub branch block's last
  use counts `shift` older, a hub head's HEAD_GAIN * max(shift, HEAD_FLOOR)
  newer; a tie goes to the lower order (loose, chain, branches, heads).
- `shift` is learned (learning.py): the split of the cache between hub
  branches and the rest that serves most sampled reuses, kept only while
  it beats LRU (a shadow LRU, else the sampled reuses, decide).
- ARC's split of the rest: the loose order is ARC's T1, the chain order its
  T2. While the loose order holds more than p blocks, its oldest go first.
  A request's first miss on a B1 ghost (a loose victim) raises p, on a B2
  ghost (a hit victim) lowers it, by P_STEP times ARC's ghost ratio (capped
  at RATIO_MAX). p starts at the capacity and stays at least P_FLOOR of it.
- Hub branches have the same rule of their own: while their order holds
  more than q blocks, its oldest go first; a first miss on a hub branch
  ghost raises q, one on a B2 ghost lowers it, by equal steps. q starts at
  the capacity and may reach 0.
- p's and q's steps are WARM_GAIN times larger at first: after n first
  misses, max(1, WARM_GAIN / (1 + n / WARM_MISSES)) steps.
- Only a request's first miss counts (a deeper block is worth nothing once
  a block before it is gone).
- A block hit for the first time moves to the chain order; a hub branch
  request's hits move to the hub heads. A ghost of a hit block stored again
  joins the chain order; a key evicted lately stored again by a hub branch
  request too (ARC's ghost hit).
- A running request's loaded head is held until it finishes (`access`).
- A store never evicts its own request's keys, and a cut store refuses the
  rest (chain.py). There is no reuse-interval shield beyond that.

Where these rules come from, and what each was measured against:
docs/design/hubchain.md and docs/POLICIES.md.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from itertools import repeat

from kvoffload.abstractions import ReqContext
from kvoffload.policies.hubchain import loops
from kvoffload.policies.hubchain.chain import PrefixChain, Request
from kvoffload.policies.hubchain.learning import A, B, SplitLearning


class _Loaded:
    """The keys a running request loaded: held until it finishes."""

    __slots__ = ("keys",)

    def __init__(self):
        self.keys: set[bytes] = set()


class HubChainPolicy(SplitLearning, PrefixChain):
    name = "hubchain"
    HUB = 8  # requests branching right after a block make it a hub
    HEAD_GAIN = 8.0  # a hub head's last use counts this many shifts newer
    HEAD_FLOOR = 1.0  # ... and at least this many requests newer, before any shift is learned
    P_STEP = 4.0  # p and q move this many blocks (times ARC's ghost ratio for p) per first miss
    RATIO_MAX = 4.0  # ARC's ratio of the ghost lists in p's step is capped here
    P_FLOOR = 0.1  # p stays at least this share of the capacity
    WARM_GAIN = 4.0  # p's and q's first steps are this many times larger ...
    WARM_MISSES = 1000  # ... falling as WARM_GAIN / (1 + first misses / WARM_MISSES) to one step
    TARGET = 512  # keys of each class sampled per split window (about), for reuse distances
    MIN_EPISODES = 50  # sampled episodes per class (weighted) before the split moves shift from 0
    FOLLOW = 0.125  # shift moves this part of the way to each split's target
    GAIN_OVER_LRU = 2.0  # the target stands while reuses gained over LRU are this many times those lost
    CHECK_MEMORY = 0.95  # those gains and losses decay by this per split
    SIM_BLOCKS = 2048  # keys the shadow LRU holds (about)
    SIM_Z = 2.0  # standard deviations its verdict needs
    SIM_ON = 1.0  # it counts while shift is at least this many requests
    SIM_MEMORY = 0.999  # its counts decay by this per split (they outlast the shift's fall)

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self._hubbed: OrderedDict[bytes, int] = OrderedDict()  # hub branches' blocks, never hit; oldest first
        self._heads: OrderedDict[bytes, int] = OrderedDict()  # hub heads (hit by a hub branch request); oldest first
        self._branches: dict[bytes, int] = {}  # resident key -> requests that branched right after it
        self._recent: OrderedDict[bytes, None] = OrderedDict()  # evicted keys (ARC's ghosts), bounded by capacity
        # ARC's split of the rest: p is the loose order's target size; B1 and
        # B2 are ghosts of loose blocks and of blocks that were hit (the chain
        # order, heads), bounded as ARC bounds them.
        self._p = float(capacity)
        # Hub branches' target q, and the ghosts of hub branch blocks evicted
        # before their first hit (at most c): their first misses raise q.
        self._q = float(capacity)
        self._learned = 0  # first misses so far (the warm-up's clock)
        self._hub_ghosts: OrderedDict[bytes, None] = OrderedDict()
        self._b1: OrderedDict[bytes, None] = OrderedDict()
        self._b2: OrderedDict[bytes, None] = OrderedDict()
        self._evicted_since = 0  # victims since the last split (one every capacity/4)
        # Keys running requests loaded (a set: C-level updates), and how many
        # hold a key that more than one holds.
        self._held: set[bytes] = set()
        self._held_more: dict[bytes, int] = {}
        self._loads = object()  # owner of each context's _Loaded (get_owned(self) holds its Request)
        self._start_learning(capacity)

    # ---- the prefix chain's hooks ---------------------------------------------

    def _orders(self) -> tuple[OrderedDict, ...]:
        return self._order, self._loose, self._hubbed, self._heads

    def _learn(self, first_miss: bytes) -> None:
        """ARC's adaptation of p, on a request's first miss only (a deeper
        miss is worth nothing once a block before it is gone): a B1 ghost
        says the loose order was too short, a B2 ghost that it was too long.
        q the same way, by equal steps: a hub branch ghost says the hub
        branch order was too short, a B2 ghost (while hub branch ghosts
        exist) that it was too long. Steps are larger early on (WARM_GAIN)."""
        self._learned += 1
        b1, b2, cap = self._b1, self._b2, self.RATIO_MAX
        step = self.P_STEP * max(1.0, self.WARM_GAIN / (1 + self._learned / self.WARM_MISSES))
        hub_ghosts = self._hub_ghosts
        if hub_ghosts:
            if first_miss in hub_ghosts:  # (in neither B1 nor B2)
                del hub_ghosts[first_miss]
                self._q = min(float(self.capacity), self._q + step)
                return
            if first_miss in b2:
                self._q = max(0.0, self._q - step)
        if first_miss in b1:
            self._p = min(float(self.capacity), self._p + step * min(cap, max(1.0, len(b2) / len(b1))))
        elif first_miss in b2:
            self._p = max(self.P_FLOOR * self.capacity, self._p - step * min(cap, max(1.0, len(b1) / len(b2))))

    def _branched(self, req: Request, parent: bytes | None) -> None:
        """Count the branch; a request branching off a hub stores hub branch blocks."""
        if parent is not None:
            n = self._branches.get(parent, 0) + 1
            self._branches[parent] = n
            req.hub = n >= self.HUB

    def _pick(self, n: int, can_evict: Callable[[bytes], bool]) -> list[bytes]:
        # can_evict is asked of the whole pick at once (C-level) when the
        # manager offers it: if all may go, the walk that asks of each in
        # turn makes the same choices.
        fast = getattr(can_evict, "all", None)
        if fast is not None:
            victims = self._merge(n, None)
            if len(victims) == n and fast(victims):
                return victims
        return self._merge(n, can_evict)

    def _merge(self, n: int, can_evict: Callable[[bytes], bool] | None) -> list[bytes]:
        """Up to n victims (can_evict None: all may go): loops.merge.
        While the hub branch order holds more than q blocks, its oldest go
        first; then while the loose order holds more than p, its oldest
        (ARC's REPLACE); then four orders, each walked from its oldest:
        loose, the chain order (stops at its first shielded block), hub branches
        (last use counts `shift` older) and hub heads (HEAD_GAIN *
        max(shift, HEAD_FLOOR) newer). The oldest head goes first; a tie to
        the lower order, so of one request's blocks stored in one step, the
        new ones (loose, its tail) go before the second uses (the chain
        order, its head)."""
        shift = self.shift
        return loops.merge(n, self._loose, self._order, self._hubbed, self._heads, self._p, self._q,
                           self._threshold, -shift, self.HEAD_GAIN * max(shift, self.HEAD_FLOOR), self._own or (),
                           self._held, can_evict)

    # ---- the EvictionPolicy contract -------------------------------------

    def insert(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        self._picked = None  # any change: admit's count is stale
        req = ctx.get_owned(self) if ctx is not None else None
        now = self._clock
        b1, b2, hub_ghosts = self._b1, self._b2, self._hub_ghosts
        if hub_ghosts and not hub_ghosts.keys().isdisjoint(keys):  # stored again: no longer a ghost
            deque(map(hub_ghosts.pop, keys, repeat(None)), 0)
        second = None  # B2 ghosts stored again: a second use of a block that was hit (ARC: to T2)
        if (b1 and not b1.keys().isdisjoint(keys)) or (b2 and not b2.keys().isdisjoint(keys)):
            second = set()
            for k in keys:
                if k in b1:
                    del b1[k]
                elif k in b2:
                    del b2[k]
                    second.add(k)
        if req is not None and req.hub:
            hubbed, order, recent = self._hubbed, self._order, self._recent
            if recent.keys().isdisjoint(keys):
                again = []
                loops.stamp(hubbed, keys, now)  # the tail lands older than the head
            else:
                again = [k for k in keys if k in recent]
                for k in reversed(keys):
                    if k in recent:  # evicted lately and back: a second use (ARC's ghost hit)
                        del recent[k]
                        order[k] = now
                    else:
                        hubbed[k] = now
            if again:
                self._follow(again, A, False)
                promoted = set(again)
                keys = [k for k in keys if k not in promoted]
            self._follow(keys, B, False)
            return
        if req is None:  # (stored outside a request)
            loops.stamp(self._order, keys, now)
        elif second:
            loose, order = self._loose, self._order
            for k in reversed(keys):
                if k in second:
                    order[k] = now
                else:
                    loose[k] = now
        else:  # never hit yet: loose (ARC's T1)
            loops.stamp(self._loose, keys, now)
        self._follow(keys, A, False)

    def insert_cold(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        b1, b2, hub_ghosts = self._b1, self._b2, self._hub_ghosts
        if b1 or b2 or hub_ghosts:  # stored again: no longer a ghost
            for k in keys:
                b1.pop(k, None)
                b2.pop(k, None)
                hub_ghosts.pop(k, None)
        super().insert_cold(keys, ctx)

    def access(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        """A running request loaded these (its head): no other request's
        store evicts them until it finishes (its later stores are its tail:
        a head lost under them makes the whole request unreachable)."""
        self._picked = None
        if ctx is None:
            return
        loaded = ctx.get_owned(self._loads)
        if loaded is None:
            loaded = _Loaded()
            ctx.set_owned(self._loads, loaded)
        held, new = self._held, set(keys)
        if loaded.keys:
            new -= loaded.keys
            loaded.keys |= new
        else:
            loaded.keys = new  # (the common case: one load per request)
        if not held.isdisjoint(new):
            more = self._held_more
            for k in held.intersection(new):  # held by another running request too
                more[k] = more.get(k, 1) + 1
        held |= new

    def _let_go(self, loaded: _Loaded | None) -> None:
        if loaded is None or not loaded.keys:
            return
        held, more, mine = self._held, self._held_more, loaded.keys
        if more:
            for k in more.keys() & mine:  # still held by another
                mine.discard(k)
                if more[k] > 2:
                    more[k] -= 1
                else:
                    del more[k]
        held -= mine
        loaded.keys = set()

    def touch(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        self._picked = None
        req = None
        if ctx is not None:
            self._let_go(ctx.get_owned(self._loads))  # its use is committed (vLLM 0.33: at the finish)
            req = ctx.get_owned(self)
        order, loose, hubbed, heads, now = self._order, self._loose, self._hubbed, self._heads, self._clock
        if req is not None and req.hub:  # a hub branch's head: a hub's path from now on
            if not (heads and loops.renew_all(heads, keys, now)):  # (the common case: all heads already, one C loop)
                if hubbed and not hubbed.keys().isdisjoint(keys):
                    for k in keys:
                        if k in hubbed:  # its first hit: a continued branch
                            del hubbed[k]
                            order[k] = now
                if heads and not heads.keys().isdisjoint(keys):
                    loops.renew(heads, keys, now)
                for k in reversed(keys):
                    if order.pop(k, None) is not None or loose.pop(k, None) is not None:
                        heads[k] = now
        else:
            used = now
            if req is None:
                self._clock = used = now + 1
            # each key to its order's newest end, the head last; a loose or hub
            # branch key's first hit moves it to the chain order
            loops.touch(keys, order, loose, heads, hubbed, used, now)
        self._follow(keys, A, True)

    def refresh(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        self._picked = None
        req = None
        if ctx is not None:
            self._let_go(ctx.get_owned(self._loads))  # the request finished
            req = ctx.get_owned(self)
        if req is None:
            self._clock += 1
        now = self._clock
        if req is not None:  # its stores are all in its class's order (unless some came back as ghosts)
            seg = self._hubbed if req.hub else self._loose
            if loops.renew_all(seg, keys, now):
                return  # (a key is in one order only: none of the others holds any)
        for seg in (self._order, self._loose, self._hubbed, self._heads):
            if seg and not seg.keys().isdisjoint(keys) and not loops.renew_all(seg, keys, now):
                loops.renew(seg, keys, now)

    def remove(self, key: bytes) -> None:
        super().remove(key)
        self._held.discard(key)
        self._held_more.pop(key, None)
        self._hubbed.pop(key, None)
        self._heads.pop(key, None)
        self._branches.pop(key, None)

    def _drop(self, victims: list[bytes]) -> None:
        # Each victim to ARC's ghosts and `recent`, then ARC's bounds
        # (loops.drop); a split every quarter of the capacity evicted.
        loops.drop(victims, self._order, self._loose, self._hubbed, self._heads, self._b1, self._b2,
                   self._hub_ghosts, self._recent, self._branches, self.capacity)
        self._evicted_since += len(victims)
        if self._evicted_since >= max(1, self.capacity // 4):
            self._evicted_since = 0
            self._split()
            self._sim_ours *= self.SIM_MEMORY  # (at every split, the first ones too)
            self._sim_lru *= self.SIM_MEMORY

    def __len__(self) -> int:
        return len(self._order) + len(self._loose) + len(self._hubbed) + len(self._heads)

    def __contains__(self, key: object) -> bool:
        return key in self._order or key in self._loose or key in self._hubbed or key in self._heads

