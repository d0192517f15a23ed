"""SIEVE (Zhang et al., NSDI'24): one FIFO, a visited bit, a moving hand.

Keys enter at the new end and never move. A use only sets the visited bit,
so a hit costs one set insertion. The hand walks from the old end towards
the new end: a visited key gets its bit cleared and stays in place, an
unvisited one is evicted. The hand keeps its place between evictions and
wraps to the old end.

The queue is a doubly linked list in two dicts (key -> newer / older
neighbour). Eviction plans a walk without touching anything and commits
bits, unlinks and the hand only once n victims were found (atomic).
"""

from __future__ import annotations

from collections.abc import Callable

from kvoffload.abstractions import ReqContext
from kvoffload.policies.base import EvictionPolicy


class SIEVEPolicy(EvictionPolicy):
    name = "sieve"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.newer: dict[bytes, bytes | None] = {}
        self.older: dict[bytes, bytes | None] = {}
        self.visited: set[bytes] = set()
        self.newest: bytes | None = None
        self.oldest: bytes | None = None
        self.hand: bytes | None = None  # next key to inspect; None: start at the oldest

    def insert(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        newer, older = self.newer, self.older
        for k in reversed(keys):  # tail first: the hand reaches the tail first
            if k in newer:
                continue
            newer[k] = None
            older[k] = self.newest
            if self.newest is None:
                self.oldest = k
            else:
                newer[self.newest] = k
            self.newest = k

    def touch(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        newer, visited = self.newer, self.visited
        for k in keys:
            if k in newer:
                visited.add(k)

    def remove(self, key: bytes) -> None:
        if key in self.newer:
            if self.hand == key:
                self.hand = self.newer[key]
            self._unlink(key)

    def _unlink(self, key: bytes) -> None:
        nw = self.newer.pop(key)
        od = self.older.pop(key)
        self.visited.discard(key)
        if nw is None:
            self.newest = od
        else:
            self.older[nw] = od
        if od is None:
            self.oldest = nw
        else:
            self.newer[od] = nw

    def evict(self, n: int, can_evict: Callable[[bytes], bool]) -> list[bytes] | None:
        if n <= 0:
            return []
        if n > len(self.newer):
            return None
        newer, visited = self.newer, self.visited
        victims: list[bytes] = []
        chosen: set[bytes] = set()
        cleared: set[bytes] = set()  # visited bits the walk cleared (planned)
        k = self.hand if self.hand is not None else self.oldest
        # Two laps suffice: the first clears every bit, the second finds
        # every evictable key.
        steps = 2 * len(newer) + 1
        while len(victims) < n and steps > 0:
            steps -= 1
            if k is None:
                k = self.oldest
            if k in chosen:
                pass
            elif k in visited and k not in cleared:
                cleared.add(k)
            elif can_evict(k):
                victims.append(k)
                chosen.add(k)
            k = newer[k]
        if len(victims) < n:
            return None
        # Commit: the hand stops at the first key after the last victim
        # that is not itself a victim.
        steps = len(newer)
        while k is not None and k in chosen and steps > 0:
            k = newer[k]
            steps -= 1
        visited -= cleared
        for v in victims:
            self._unlink(v)
        self.hand = k if k in newer else None
        return victims

    def __len__(self) -> int:
        return len(self.newer)

    def __contains__(self, key: object) -> bool:
        return key in self.newer
