"""Least recently used: one OrderedDict, oldest first, in which a running
request's stored keys keep prefix order (policies._grouped)."""

from __future__ import annotations

from collections.abc import Callable

from kvoffload.abstractions import ReqContext
from kvoffload.policies._grouped import GroupedOrder
from kvoffload.policies.base import EvictionPolicy


class LRUPolicy(EvictionPolicy):
    name = "lru"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self._keys = GroupedOrder()  # oldest first: keys, and groups of a request's keys

    def insert(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        if ctx is not None and keys and keys[-1] in ctx._offload_key_positions:
            # a request's keys (with positions, as vLLM gives): ranked with its earlier stores, tail first
            self._keys.add_grouped(keys, self, ctx)
            return
        # Reversed: the tail lands older than the head, so it goes first.
        order = self._keys.order
        for k in reversed(keys):
            order[k] = None  # the manager inserts only keys it does not hold
        self._keys.n += len(keys)

    def insert_cold(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        order = self._keys.order
        move = order.move_to_end
        for k in keys:  # head first to the old end: the tail ends up oldest
            order[k] = None
            move(k, last=False)
        self._keys.n += len(keys)

    def touch(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        order, owner = self._keys.order, self._keys.owner
        if owner and self._keys.ungroup_all(keys):  # a finished request's stores, at once
            order.update(dict.fromkeys(reversed(keys)))
            return
        move = order.move_to_end
        for k in reversed(keys):
            group = owner.pop(k, None)
            if group is None:
                try:
                    move(k)
                except KeyError:
                    pass
            else:  # a grouped key (a request's store): now ranked on its own
                g = group.keys
                del g[k]
                if not g:
                    del order[group]
                order[k] = None

    refresh = touch  # recency is all LRU knows

    def remove(self, key: bytes) -> None:
        self._keys.remove(key)

    def evict(self, n: int, can_evict: Callable[[bytes], bool]) -> list[bytes] | None:
        if n <= 0:
            return []
        keys = self._keys
        if n > len(keys):
            return None
        victims = keys.pick(n, can_evict)
        if len(victims) < n:
            return None
        keys.remove_all(victims)
        return victims

    def __len__(self) -> int:
        return self._keys.n

    def __contains__(self, key: object) -> bool:
        return key in self._keys
