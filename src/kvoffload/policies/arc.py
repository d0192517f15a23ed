"""Adaptive replacement cache (Megiddo & Modha, 2003).

T1 holds keys seen once, T2 keys seen again (touched, or re-stored soon
after eviction). B1/B2 are ghosts: keys recently evicted from T1/T2, no
data. A re-store of a B1 ghost says "recency list too short" and raises the
target size p of T1; a B2 ghost lowers it. Eviction takes from T1 while it
is larger than p, else from T2.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator

from kvoffload.abstractions import ReqContext
from kvoffload.policies.base import EvictionPolicy


def _next_evictable(it: Iterator[bytes], can_evict: Callable[[bytes], bool]) -> bytes | None:
    for k in it:
        if can_evict(k):
            return k
    return None


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
        # Reversed: the tail lands older than the head, so it goes first.
        for k in reversed(keys):
            if k in b1:
                self.p = min(self.p + max(1.0, len(b2) / len(b1)), float(self.capacity))
                del b1[k]
                t2[k] = None
            elif k in b2:
                self.p = max(self.p - max(1.0, len(b1) / len(b2)), 0.0)
                del b2[k]
                t2[k] = None
            elif k in t2:
                t2.move_to_end(k)
            else:
                t1[k] = None
                t1.move_to_end(k)
        self._trim_ghosts()

    def touch(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        t1, t2 = self.t1, self.t2
        for k in reversed(keys):
            if k in t1:
                del t1[k]
                t2[k] = None
            elif k in t2:
                t2.move_to_end(k)

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
        # Plan first, commit only if n victims were found (atomic).
        it1, it2 = iter(t1), iter(t2)
        left1, left2 = len(t1), len(t2)  # entries not yet chosen, for the T1-vs-p rule
        from1: list[bytes] = []
        from2: list[bytes] = []
        done1 = done2 = False
        while len(from1) + len(from2) < n:
            prefer1 = left1 > 0 and (left1 > self.p or left2 == 0)
            k = None
            for use1 in ((True, False) if prefer1 else (False, True)):
                if use1 and not done1:
                    k = _next_evictable(it1, can_evict)
                    if k is None:
                        done1 = True
                    else:
                        from1.append(k)
                        left1 -= 1
                        break
                elif not use1 and not done2:
                    k = _next_evictable(it2, can_evict)
                    if k is None:
                        done2 = True
                    else:
                        from2.append(k)
                        left2 -= 1
                        break
            if k is None:
                return None
        b1, b2 = self.b1, self.b2
        for k in from1:
            del t1[k]
            b1[k] = None
        for k in from2:
            del t2[k]
            b2[k] = None
        self._trim_ghosts()
        return from1 + from2

    def _trim_ghosts(self) -> None:
        # ARC's directory bounds: |T1|+|B1| <= c and |T1|+|T2|+|B1|+|B2| <= 2c.
        c = self.capacity
        b1, b2 = self.b1, self.b2
        while b1 and len(self.t1) + len(b1) > c:
            b1.popitem(last=False)
        while len(self.t1) + len(self.t2) + len(b1) + len(b2) > 2 * c:
            (b2 or b1).popitem(last=False)

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def __contains__(self, key: object) -> bool:
        return key in self.t1 or key in self.t2
