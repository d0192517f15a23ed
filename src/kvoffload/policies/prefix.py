"""Prefix-aware LRU ("prefix"): LRU order, extra life for blocks whose
prefix was reused, tails of prefixes first, and a memory of evicted keys.
Every rule switches itself on or off from what the workload shows, so the
policy falls back to plain LRU where a rule does not pay.

- Reuse counts and protection. A block reused c times (c capped at 2) that
  reaches the old end of the queue within c * window of its last use goes
  back to the new end instead of out (a CLOCK-style second chance: the
  queue stays one OrderedDict). window = min(typical reuse age, life *
  capacity): the typical age is a running 90th percentile of the ages (in
  stored blocks) at which blocks are reused, the workload's own time scale;
  life adapts like ARC's target: ghost hits on blocks evicted after their
  protection lengthen it, ghost hits on unprotected ones shorten it.
  Protection is on only while P(reused again | reused) is clearly above
  P(reused): on Mooncake it is 0.42 against 0.24.
- Ghost counts. Reuse often comes after the block was evicted once (think
  time between turns outlasts a fresh block's stay), so the state of the
  last 4 * capacity evicted keys is kept (keys only, no data) and a
  re-stored key resumes its count: a re-store is a reuse.
- Leaves. The last key of a stored run has no child yet. On traces whose
  last prompt block is partial (Mooncake) such leaves are almost never
  reused (0.8% against 25%); on chats whose every turn extends the previous
  one they are reused like any block. The policy measures both first-reuse
  rates and, only while leaves are reused less than half as often, queues
  new leaves at the old end (evicted first). A later call of the same
  request that continues the run turns the leaf into an inner block.
- Tail first: within one call keys are queued tail first, and a block is
  never fresher or better counted than its prefix, so a child goes before
  its parent.

The per-request state (the last key a request handed over) lives in the
ReqContext, so nothing leaks when requests end.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from kvoffload.abstractions import ReqContext
from kvoffload.policies.base import EvictionPolicy


class _LastKey:
    """Per-request scratch: the last key this request handed to the policy,
    and whether its touches were counted already (a scheduler may touch a
    request's blocks more than once; that is one use, not several)."""

    __slots__ = ("key", "touched")

    def __init__(self, key: bytes):
        self.key = key
        self.touched = False


class PrefixAwarePolicy(EvictionPolicy):
    name = "prefix"

    TOP = 2  # reuse counts are capped here
    # Protection per reuse: one typical reuse age, but at most `life`
    # capacities of stored blocks, life adapted within these bounds.
    LIFE_INIT, MIN_LIFE, MAX_LIFE = 1.0, 0.25, 2.0
    ADAPT = 1.02  # step of life per insert that hit recent ghosts
    FREQ_SIGNAL = 1.5  # protect while P(reuse again | reused) > this * P(reuse)
    GHOST_SHARE = 4.0  # remembered evicted keys, as a multiple of capacity
    LEAF_DEMOTE_RATIO = 0.5  # demote leaves while their reuse rate < ratio * inner rate
    AGE_QUANTILE = 0.9  # the "typical" reuse age: this quantile of observed ages
    _STEP = 1.02  # multiplicative step of the running quantile

    # A key's state is one int: (clock at last use) << 3 | code, where code
    # is 4 + reuse count for an inner block and 3 - reuse count for a leaf.

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.order: OrderedDict[bytes, int] = OrderedDict()  # key -> state, oldest first
        # Evicted keys -> state, in two generations (a cheap bounded FIFO).
        self.ghost: dict[bytes, int] = {}
        self.ghost_old: dict[bytes, int] = {}
        self.ghost_gen = max(1, int(capacity * self.GHOST_SHARE / 2))
        self.clock = 0  # blocks stored so far: ages are in stored blocks
        self.reuse_age = float(capacity)
        self._up = self._STEP ** self.AGE_QUANTILE
        self._down = self._STEP ** (1.0 - self.AGE_QUANTILE)
        # Reuse statistics per kind: [stored, reused], halved as they grow.
        self.leaf_stats = [1.0, 0.0]
        self.inner_stats = [1.0, 0.0]
        self.demote = False
        self.life = self.LIFE_INIT
        self.reused_again = 0.0
        self.protect = False
        # Evictions and ghost hits of protected / unprotected blocks (decayed).
        self.evicted_prot = self.evicted_plain = 1.0
        self.ghost_hits_prot = self.ghost_hits_plain = 0.0

    # -- learning ---------------------------------------------------------------

    def _saw_reuse(self, age: int) -> None:
        # Stochastic quantile tracking: converges to the AGE_QUANTILE of ages.
        if age > self.reuse_age:
            self.reuse_age *= self._up
        else:
            self.reuse_age /= self._down

    def _adapt_life(self, ghost_prot: int, ghost_plain: int) -> None:
        """ARC's idea on the protection window: if blocks evicted after their
        protection come back more often (per eviction) than blocks evicted
        unprotected, protection was too short, else too long."""
        self.ghost_hits_prot += ghost_prot
        self.ghost_hits_plain += ghost_plain
        if self.ghost_hits_prot * self.evicted_plain > self.ghost_hits_plain * self.evicted_prot:
            self.life = min(self.life * self.ADAPT, self.MAX_LIFE)
        else:
            self.life = max(self.life / self.ADAPT, self.MIN_LIFE)
        if self.evicted_plain + self.evicted_prot > 4 * self.capacity:
            self.evicted_plain /= 2
            self.evicted_prot /= 2
            self.ghost_hits_plain /= 2
            self.ghost_hits_prot /= 2

    def _count_reuse(self, leaves: int, inner: int, stored_leaves: int, stored_inner: int) -> None:
        ls, ins = self.leaf_stats, self.inner_stats
        ls[0] += stored_leaves
        ls[1] += leaves
        ins[0] += stored_inner
        ins[1] += inner
        if ins[0] > 4 * self.capacity:  # forget slowly, follow the workload
            ls[0] *= 0.5
            ls[1] *= 0.5
            ins[0] *= 0.5
            ins[1] *= 0.5
            self.reused_again *= 0.5
        # Is a reuse a sign of more? Compare P(reused again | reused once)
        # with P(reused at all); protect reused blocks only if clearly higher.
        first = ls[1] + ins[1]
        self.protect = self.reused_again > self.FREQ_SIGNAL * first * first / (ls[0] + ins[0])
        self.demote = ls[1] / ls[0] < self.LEAF_DEMOTE_RATIO * ins[1] / ins[0]

    # -- leaves -------------------------------------------------------------------

    def _follow(self, keys: list[bytes], ctx: ReqContext | None, stores: bool) -> _LastKey | None:
        """Remember the request's last key; if this call stores new keys, they
        continue the request and the previous last key got a child: un-leaf
        it. (A touch after a store re-uses the head: no child.)"""
        if ctx is None:
            return None
        last = ctx.get_state(_LastKey)
        if last is None:
            last = _LastKey(keys[-1])
            ctx.set_state(last)
            return last
        st = self.order.get(last.key)
        if stores and st is not None and last.key != keys[-1] and (st & 7) < 4:
            self.order[last.key] = (st & ~7) | (7 - (st & 7))  # leaf count c -> inner count c
            self.leaf_stats[0] = max(1.0, self.leaf_stats[0] - 1)  # it was counted as a stored leaf
            self.inner_stats[0] += 1
        last.key = keys[-1]
        return last

    # -- EvictionPolicy -------------------------------------------------------

    def insert(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        if not keys:
            return
        self._follow(keys, ctx, stores=True)
        order, ghost, ghost_old = self.order, self.ghost, self.ghost_old
        self.clock += len(keys)
        stamp = self.clock << 3
        leaf_reused = inner_reused = ghost_prot = ghost_plain = again = 0
        age = -1
        first = True
        for k in reversed(keys):  # tail first: the tail lands older
            if k in order:
                first = False
                continue  # already held: a second store changes nothing
            g = ghost.pop(k, None)
            if g is not None:  # recently evicted: a sign the eviction was premature
                if g & 7 > 4:
                    ghost_prot += 1
                else:
                    ghost_plain += 1
            else:
                g = ghost_old.pop(k, None)
            if g is None:
                c = 0
            else:  # a re-store of an evicted key is a reuse
                code = g & 7
                if age < 0:
                    age = self.clock - (g >> 3)
                if code < 4:
                    c = 3 - code
                    leaf_reused += c == 0
                else:
                    c = code - 4
                    inner_reused += c == 0
                again += c == 1
                if c < self.TOP:
                    c += 1
            if first:  # the tail: no child yet
                order[k] = stamp | (3 - c)
                if self.demote:
                    order.move_to_end(k, last=False)
                first = False
            else:
                order[k] = stamp | (4 + c)
        if age >= 0:
            self._saw_reuse(age)
        if ghost_prot or ghost_plain:
            self._adapt_life(ghost_prot, ghost_plain)
        self.reused_again += again
        self._count_reuse(leaf_reused, inner_reused, 1, len(keys) - 1)

    def insert_cold(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        # Counted like any store (ghost reuse, leaf state), then queued at
        # the old end, head first so the tail ends up oldest.
        self.insert(keys, ctx)
        move = self.order.move_to_end
        for k in keys:
            if k in self.order:
                move(k, last=False)

    def touch(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        if not keys:
            return
        req = self._follow(keys, ctx, stores=False)
        order = self.order
        get, move = order.get, order.move_to_end
        if req is not None:
            if req.touched:  # this request's use was counted: recency only
                for k in reversed(keys):
                    if k in order:
                        move(k)
                return
            req.touched = True
        stamp = self.clock << 3
        top = 4 + self.TOP
        reused = leaf_reused = again = 0
        first = True
        age_of = -1
        for k in reversed(keys):
            st = get(k)
            if st is None:
                continue
            code = st & 7
            if age_of < 0:
                age_of = st >> 3
            again += code == 5 or code == 2
            if code >= 4:
                reused += code == 4
                order[k] = stamp | (code + 1 if code < top else top)
            else:  # a leaf: still one only as the last key
                leaf_reused += code == 3
                c = 3 - code
                if c < self.TOP:
                    c += 1
                order[k] = stamp | ((3 - c) if first else (4 + c))
            move(k)
            first = False
        if age_of >= 0:
            self._saw_reuse(self.clock - age_of)
        self.leaf_stats[1] += leaf_reused
        self.inner_stats[1] += reused
        self.reused_again += again

    def remove(self, key: bytes) -> None:
        self.order.pop(key, None)

    def evict(self, n: int, can_evict: Callable[[bytes], bool]) -> list[bytes] | None:
        if n <= 0:
            return []
        order = self.order
        if n > len(order):
            return None
        popitem = order.popitem
        now = self.clock
        window = min(self.reuse_age, self.life * self.capacity) if self.protect else -1.0
        ghost = self.ghost
        victims: list[bytes] = []
        popped: list[bytes] = []  # every key taken off the old end, in order (for undo)
        pinned: list[tuple[bytes, int]] = []
        second_chances = len(order)  # one whole pass at most, then protection ends
        prot = 0  # victims whose protection had expired
        while len(victims) < n:
            if not order:
                self._undo(popped, pinned)
                return None
            k, st = popitem(last=False)
            popped.append(k)
            code = st & 7
            if code > 4 and second_chances and (st >> 3) + (code - 4) * window > now:
                order[k] = st  # protected: back to the new end
                second_chances -= 1
            elif not can_evict(k):
                pinned.append((k, st))
            else:
                victims.append(k)
                ghost[k] = st
                prot += code > 4
        self.evicted_prot += prot
        self.evicted_plain += n - prot
        move = order.move_to_end
        for k, st in reversed(pinned):  # back to the old end, in their order
            order[k] = st
            move(k, last=False)
        if len(ghost) >= self.ghost_gen:
            self.ghost_old = ghost
            self.ghost = {}
        return victims

    def _undo(self, popped: list[bytes], pinned: list[tuple[bytes, int]]) -> None:
        """A failed evict examined every key: rebuild the queue from the pop
        order (a key's first pop is its original place)."""
        order, ghost = self.order, self.ghost
        state = dict(pinned)
        state.update(order)  # second chances still queued, state unchanged
        order.clear()
        for k in popped:
            if k not in order:
                st = state.get(k)
                order[k] = ghost.pop(k) if st is None else st

    def __len__(self) -> int:
        return len(self.order)

    def __contains__(self, key: object) -> bool:
        return key in self.order
