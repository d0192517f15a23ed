"""Adaptive replacement cache (Megiddo & Modha, 2003).

T1 holds keys seen once, T2 keys seen again (touched, or re-stored soon
after eviction). B1/B2 are ghosts: keys recently evicted from T1/T2, no
data. A re-store of a B1 ghost says "recency list too short" and raises the
target size p of T1; a B2 ghost lowers it. Eviction takes from T1 while it
is larger than p, else from T2.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from itertools import islice, repeat

from kvoffload.abstractions import ReqContext
from kvoffload.policies.base import EvictionPolicy

_ABSENT = object()


def _pick(it: Iterator[bytes], n: int, can_evict: Callable[[bytes], bool]) -> list[bytes]:
    """Up to n evictable keys from it, oldest first; it stops right after
    the last one picked. The next n keys are usually all evictable: checked
    in one C-level call when the manager offers can_evict.all."""
    if n <= 0:
        return []
    batch = list(islice(it, n))
    check_all = getattr(can_evict, "all", None)
    if check_all is not None and len(batch) == n and check_all(batch):
        return batch
    picked = list(filter(can_evict, batch))
    if len(picked) < n:
        picked += islice(filter(can_evict, it), n - len(picked))
    return picked


class ARCPolicy(EvictionPolicy):
    name = "arc"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.t1: OrderedDict[bytes, None] = OrderedDict()  # oldest first
        self.t2: OrderedDict[bytes, None] = OrderedDict()
        self.b1: OrderedDict[bytes, None] = OrderedDict()
        self.b2: OrderedDict[bytes, None] = OrderedDict()
        self.p = 0.0  # target size of T1

    def insert(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        t1, t2, b1, b2 = self.t1, self.t2, self.b1, self.b2
        if len(keys) > 4 and b1.keys().isdisjoint(keys) and b2.keys().isdisjoint(keys):
            # No ghost hit in a batch (C-level checks): all go to T1, tail oldest.
            for k in reversed(keys):
                t1[k] = None
        else:
            for k in reversed(keys):
                if k in b1:
                    self.p = min(self.p + max(1.0, len(b2) / len(b1)), float(self.capacity))
                    del b1[k]
                    t2[k] = None
                elif k in b2:
                    self.p = max(self.p - max(1.0, len(b1) / len(b2)), 0.0)
                    del b2[k]
                    t2[k] = None
                else:
                    t1[k] = None
        self._trim_ghosts()

    def touch(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        t1, t2 = self.t1, self.t2
        pop1, move2 = t1.pop, t2.move_to_end
        # Reversed, so the head ends up most recent in T2.
        for k in reversed(keys):
            if pop1(k, _ABSENT) is _ABSENT:
                try:
                    move2(k)
                except KeyError:
                    pass
            else:
                t2[k] = None

    def refresh(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        # Re-rank within the key's own list: storing is not a second use.
        t1, t2 = self.t1, self.t2
        move1, move2 = t1.move_to_end, t2.move_to_end
        for k in reversed(keys):
            try:
                move1(k)  # almost always in T1 (just stored)
            except KeyError:
                if k in t2:
                    move2(k)

    def remove(self, key: bytes) -> None:
        if key in self.t1:
            del self.t1[key]
        else:
            self.t2.pop(key, None)

    def evict(self, n: int, can_evict: Callable[[bytes], bool]) -> list[bytes] | None:
        if n <= 0:
            return []
        t1, t2 = self.t1, self.t2
        if n > len(t1) + len(t2):
            return None
        # REPLACE with p fixed for the whole batch: take from T1 while it is
        # larger than p, then from T2, then T1 again if T2 ran out; a list
        # with nothing evictable left hands over to the other. Plan first,
        # commit only if n victims were found (atomic).
        it1 = iter(t1)
        from1 = _pick(it1, min(n, len(t1) - int(self.p)), can_evict)
        from2 = _pick(iter(t2), n - len(from1), can_evict)
        if len(from1) + len(from2) < n:
            from1 += _pick(it1, n - len(from1) - len(from2), can_evict)
            if len(from1) + len(from2) < n:
                return None
        b1, b2 = self.b1, self.b2
        for k in from1:
            del t1[k]
            b1[k] = None
        for k in from2:
            del t2[k]
            b2[k] = None
        # No ghost trimming here: T1->B1 and T2->B2 keep |T1|+|B1| and the
        # directory's size as they were (within bounds since the last insert).
        return from1 + from2

    def _trim_ghosts(self) -> None:
        # ARC's directory bounds: |T1|+|B1| <= c and |T1|+|T2|+|B1|+|B2| <= 2c.
        # (oldest ghosts first; C-level pops: about one per stored key once full)
        c, b1, b2 = self.capacity, self.b1, self.b2
        over1 = min(len(self.t1) + len(b1) - c, len(b1))
        if over1 > 0:
            deque(map(b1.popitem, repeat(False, over1)), 0)
        over = len(self.t1) + len(self.t2) + len(b1) + len(b2) - 2 * c
        if over > 0:
            from2 = min(over, len(b2))
            deque(map(b2.popitem, repeat(False, from2)), 0)
            deque(map(b1.popitem, repeat(False, over - from2)), 0)

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def __contains__(self, key: object) -> bool:
        return key in self.t1 or key in self.t2
