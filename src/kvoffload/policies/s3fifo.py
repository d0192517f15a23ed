"""S3-FIFO (Yang et al., SOSP'23): three FIFO queues.

New keys enter a small FIFO (a tenth of the capacity). A key leaving it is
promoted to the main FIFO if it was used again meanwhile, else evicted and
remembered in a ghost FIFO (keys only). A re-store of a ghost key goes
straight to main. Main is a CLOCK: a key leaving it with a use count above
zero is re-queued with the count lowered. Quick demotion of keys seen once
is the point: most offloaded blocks are never reused.

Atomic eviction: re-queueing and promotion are internal moves, but they
would change later choices, so `evict` first checks that n evictable keys
exist and only then runs the (then always successful) eviction loop.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from kvoffload.abstractions import ReqContext
from kvoffload.policies.base import EvictionPolicy


class S3FIFOPolicy(EvictionPolicy):
    name = "s3fifo"

    SMALL_SHARE = 0.1
    MAX_FREQ = 3

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.small: OrderedDict[bytes, int] = OrderedDict()  # key -> use count, oldest first
        self.main: OrderedDict[bytes, int] = OrderedDict()
        self.ghost: OrderedDict[bytes, None] = OrderedDict()
        self.small_target = max(1, int(capacity * self.SMALL_SHARE))
        self.ghost_cap = max(1, capacity - self.small_target)

    def insert(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        small, main, ghost = self.small, self.main, self.ghost
        for k in reversed(keys):  # tail first: the tail leaves first
            if k in small or k in main:
                continue
            if k in ghost:
                del ghost[k]
                main[k] = 0
            else:
                small[k] = 0

    def touch(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        small, main, top = self.small, self.main, self.MAX_FREQ
        for k in keys:
            f = small.get(k)
            if f is not None:
                if f < top:
                    small[k] = f + 1
                continue
            f = main.get(k)
            if f is not None and f < top:
                main[k] = f + 1

    def remove(self, key: bytes) -> None:
        if self.small.pop(key, None) is None:
            self.main.pop(key, None)

    def _has_evictable(self, n: int, can_evict: Callable[[bytes], bool]) -> bool:
        found = 0
        for q in (self.small, self.main):
            for k in q:
                if can_evict(k):
                    found += 1
                    if found == n:
                        return True
        return False

    def evict(self, n: int, can_evict: Callable[[bytes], bool]) -> list[bytes] | None:
        if n <= 0:
            return []
        if n > len(self) or not self._has_evictable(n, can_evict):
            return None
        small, main, ghost = self.small, self.main, self.ghost
        out: list[bytes] = []
        # Pops since the last victim/promotion in each queue: past these
        # bounds the queue holds only pinned keys (each was passed over).
        small_skips = main_skips = 0
        while len(out) < n:
            small_dry = small_skips >= len(small)
            main_dry = not main or main_skips > (self.MAX_FREQ + 1) * len(main)
            if not small_dry and (len(small) > self.small_target or main_dry):
                k, f = small.popitem(last=False)
                if f > 0:
                    main[k] = 0
                    main_skips = 0  # a fresh evictable candidate in main
                elif can_evict(k):
                    out.append(k)
                    ghost[k] = None
                    small_skips = 0
                else:
                    small[k] = f
                    small_skips += 1
            else:
                k, f = main.popitem(last=False)
                if f > 0:
                    main[k] = f - 1
                    main_skips += 1
                elif can_evict(k):
                    out.append(k)
                    main_skips = 0
                else:
                    main[k] = 0
                    main_skips += 1
        while len(ghost) > self.ghost_cap:
            ghost.popitem(last=False)
        return out

    def __len__(self) -> int:
        return len(self.small) + len(self.main)

    def __contains__(self, key: object) -> bool:
        return key in self.small or key in self.main
