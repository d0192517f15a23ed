"""Least recently used: one OrderedDict, oldest first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from kvoffload.abstractions import ReqContext
from kvoffload.policies.base import EvictionPolicy


class LRUPolicy(EvictionPolicy):
    name = "lru"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self._order: OrderedDict[bytes, None] = OrderedDict()  # oldest first

    def insert(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        # Reversed: the tail lands older than the head, so it goes first.
        order = self._order
        for k in reversed(keys):
            order[k] = None  # the manager inserts only keys it does not hold

    def insert_cold(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        order = self._order
        move = order.move_to_end
        for k in keys:  # head first to the old end: the tail ends up oldest
            order[k] = None
            move(k, last=False)

    def touch(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        move = self._order.move_to_end
        for k in reversed(keys):
            try:
                move(k)
            except KeyError:
                pass

    refresh = touch  # recency is all LRU knows

    def remove(self, key: bytes) -> None:
        self._order.pop(key, None)

    def evict(self, n: int, can_evict: Callable[[bytes], bool]) -> list[bytes] | None:
        if n <= 0:
            return []
        order = self._order
        if n > len(order):
            return None
        victims = []
        for k in order:
            if can_evict(k):
                victims.append(k)
                if len(victims) == n:
                    break
        else:
            return None
        for k in victims:
            del order[k]
        return victims

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order
