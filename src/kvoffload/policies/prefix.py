"""Prefix-aware LRU ("prefix"): recency, weighted by how often a block's
prefix was reused, with the tails of prefixes going first.

Why each part (measured on the Mooncake trace, docs/BENCHMARKS.md):
- Reuse classes. A block reused before is about twice as likely to be
  reused again as a fresh one. Each block sits in the LRU queue of its reuse
  count (0, 1, 2+); a block of class c counts as `c * bonus` blocks younger
  than its last use, where bonus is a share of the capacity (scale-free).
  Eviction takes the oldest of the queue heads by that adjusted age.
- Ghost counts. Most reuse comes after the block was evicted once (think
  time between turns is longer than the cache holds a fresh block), so the
  reuse count of recently evicted keys is kept (keys only, no data) and a
  re-stored key resumes it: a re-store is a reuse.
- Leaves. The last block of a stored run has no child yet. On traces whose
  last prompt block is partial (Mooncake), such leaves are almost never
  reused, so they are worth evicting first; on chats whose every turn
  extends the previous one they are reused like any block. The policy
  measures the reuse rate of leaves and of inner blocks and demotes leaves
  only while leaves are reused less than half as often.
- Tail first: within one call keys are queued tail first, and a block is
  never in a better class or fresher than its prefix, so with the classes a
  child goes before its parent.

Per-request state (the last key handed over for a request, to tell a leaf's
child when a request stores in several calls) lives in the ReqContext, so
nothing leaks when requests end.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from kvoffload.abstractions import ReqContext
from kvoffload.policies.base import EvictionPolicy


class _LastKey:
    """Per-request scratch: the last key this request handed to the policy."""

    __slots__ = ("key",)

    def __init__(self, key: bytes):
        self.key = key


class PrefixAwarePolicy(EvictionPolicy):
    name = "prefix"

    CLASSES = 3  # reuse counts 0, 1, 2+
    BONUS_SHARE = 0.25  # extra life per reuse class, as a share of capacity
    GHOST_SHARE = 4.0  # remembered evicted keys, as a multiple of capacity
    LEAF_DEMOTE_RATIO = 0.5  # demote leaves while their reuse rate < ratio * inner rate

    def __init__(self, capacity: int):
        super().__init__(capacity)
        # queues[c]: key -> clock at last use, oldest first; queues[-1] holds leaves.
        self.queues: list[OrderedDict[bytes, int]] = [OrderedDict() for _ in range(self.CLASSES + 1)]
        self.count: dict[bytes, int] = {}  # resident key -> reuse count; negative: leaf (-1 - count)
        self.ghost: OrderedDict[bytes, int] = OrderedDict()  # evicted key -> its count code
        self.ghost_cap = max(1, int(capacity * self.GHOST_SHARE))
        self.bonus = max(1, int(capacity * self.BONUS_SHARE))
        self.clock = 0  # blocks stored so far: ages are in stored blocks
        # Reuse statistics per kind: [stored, reused], halved as they grow.
        self.leaf_stats = [1.0, 0.0]
        self.inner_stats = [1.0, 0.0]

    # -- leaf bookkeeping -------------------------------------------------

    def _demote_leaves(self) -> bool:
        leaf = self.leaf_stats[1] / self.leaf_stats[0]
        inner = self.inner_stats[1] / self.inner_stats[0]
        return leaf < self.LEAF_DEMOTE_RATIO * inner

    def _note(self, stats: list[float], stored: int, reused: int) -> None:
        stats[0] += stored
        stats[1] += reused
        if stats[0] > 4 * self.capacity:  # forget slowly, follow the workload
            stats[0] *= 0.5
            stats[1] *= 0.5

    def _unleaf(self, key: bytes) -> None:
        """`key` got a child: it is an inner block now."""
        code = self.count.get(key)
        if code is None or code >= 0:
            return
        c = -1 - code
        stamp = self.queues[-1].pop(key)
        self.count[key] = c
        self.queues[min(c, self.CLASSES - 1)][key] = stamp

    def _follow(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        """Remember the request's last key; un-leaf the previous one if this
        call continues it."""
        if ctx is None:
            return
        last = ctx.get_state(_LastKey)
        if last is None:
            ctx.set_state(_LastKey(keys[-1]))
            return
        if last.key != keys[-1]:
            self._unleaf(last.key)
        last.key = keys[-1]

    # -- EvictionPolicy -----------------------------------------------------

    def insert(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        if not keys:
            return
        self._follow(keys, ctx)
        count, queues, ghost = self.count, self.queues, self.ghost
        top = self.CLASSES - 1
        leaf_reused = inner_reused = 0
        self.clock += len(keys)
        now = self.clock
        last = len(keys) - 1
        for i in range(last, -1, -1):  # tail first: the tail lands older
            k = keys[i]
            if k in count:
                continue  # already tracked: a store of a held key changes nothing
            g = ghost.pop(k, None)
            if g is None:
                c = 0
            else:  # a re-store of an evicted key is a reuse
                if g < 0:
                    leaf_reused += 1
                    g = -1 - g
                else:
                    inner_reused += 1
                c = g + 1
            if i == last:  # no child yet; biased only while leaves are demoted
                count[k] = -1 - c
                queues[-1][k] = now
            else:
                count[k] = c
                queues[c if c < top else top][k] = now
        self._note(self.leaf_stats, 1, leaf_reused)
        self._note(self.inner_stats, last, inner_reused)

    def touch(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        if not keys:
            return
        self._follow(keys, ctx)
        count, queues = self.count, self.queues
        top = self.CLASSES - 1
        now = self.clock
        leaf_reused = inner_reused = 0
        last = len(keys) - 1
        for i in range(last, -1, -1):
            k = keys[i]
            code = count.get(k)
            if code is None:
                continue
            if code < 0:  # a leaf reused: it stays a leaf only if still the last key
                leaf_reused += 1
                old, c = queues[-1], -1 - code
            else:
                inner_reused += 1
                c = code
                old = queues[c if c < top else top]
            del old[k]
            c += 1
            if i == last and code < 0:
                count[k] = -1 - c
                queues[-1][k] = now
            else:
                count[k] = c
                queues[c if c < top else top][k] = now
        self.leaf_stats[1] += leaf_reused
        self.inner_stats[1] += inner_reused

    def remove(self, key: bytes) -> None:
        code = self.count.pop(key, None)
        if code is None:
            return
        if code < 0:
            del self.queues[-1][key]
        else:
            del self.queues[min(code, self.CLASSES - 1)][key]

    def evict(self, n: int, can_evict: Callable[[bytes], bool]) -> list[bytes] | None:
        if n <= 0:
            return []
        if n > len(self.count):
            return None
        # Plan: merge the queue heads by adjusted age, skipping pinned keys;
        # commit only once n victims are found (atomic).
        queues = self.queues
        leaf_bias = -(1 << 62) if self._demote_leaves() else 0
        bias = [c * self.bonus for c in range(self.CLASSES)] + [leaf_bias]
        iters = [iter(q.items()) for q in queues]
        heads: list[tuple[bytes, int] | None] = [self._next(it, can_evict) for it in iters]
        victims: list[tuple[bytes, int]] = []
        while len(victims) < n:
            best = -1
            best_age = 0
            for qi, h in enumerate(heads):
                if h is not None and (best < 0 or h[1] + bias[qi] < best_age):
                    best, best_age = qi, h[1] + bias[qi]
            if best < 0:
                return None
            victims.append((heads[best][0], best))
            heads[best] = self._next(iters[best], can_evict)
        count, ghost = self.count, self.ghost
        out = []
        for k, qi in victims:
            del queues[qi][k]
            ghost[k] = count.pop(k)
            out.append(k)
        while len(ghost) > self.ghost_cap:
            ghost.popitem(last=False)
        return out

    @staticmethod
    def _next(it, can_evict: Callable[[bytes], bool]) -> tuple[bytes, int] | None:
        for item in it:
            if can_evict(item[0]):
                return item
        return None

    def __len__(self) -> int:
        return len(self.count)

    def __contains__(self, key: object) -> bool:
        return key in self.count
