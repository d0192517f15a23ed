"""Least recently used: one OrderedDict, oldest first.

A running request keeps prefix order across its store batches, as vLLM
0.33's LRU ranks it: its stored keys (those with positions) rank together,
at its first store, tail first. Ranking each batch at its arrival would let
a running request's later batches (its tail) outlive its first (its head):
under pressure the head would go first and what it stored would become
unreachable (a prefix is read from its head). So a key's value in the
OrderedDict is the group of the running request that stored it (None
once used, re-ranked, or stored outside a request): evict, reaching the
oldest key of a live group, takes that group's keys tail first. When the
request finishes, the manager's refresh re-ranks its keys and the group
dies. Per key: one list entry in its group; no per-key objects. The group
is drained in token-position order, tail first (batches may be offered or
complete out of order: a backfill, a reversed completion); it is sorted only
when a batch arrived ranked before the previous one. Keys the running
request loads join its group too (access(): moved to the newest end), so a
reused prefix outlives the tail the request then stores, as in vLLM 0.33.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from itertools import islice

from kvoffload.abstractions import ReqContext
from kvoffload.policies.base import EvictionPolicy


_NO_POSITION = float("inf")
BATCH_MIN = 64  # keys per call from which the C-level paths beat a Python loop (measured: 16 slower, 64 even)


class _Group:
    """A running request's stored (and loaded) keys, head first while
    in_order, and the request's key positions."""

    __slots__ = ("keys", "live", "positions", "in_order")

    def __init__(self, positions: dict):
        self.keys: list[bytes] = []  # may list keys gone since: checked against the order
        self.live = True
        self.positions = positions
        self.in_order = True

    def add(self, keys: list[bytes]) -> None:
        if self.in_order and self.keys:
            get = self.positions.get  # a batch ranked before the last one: sort at drain
            self.in_order = get(keys[0], _NO_POSITION) >= get(self.keys[-1], _NO_POSITION)
        self.keys += keys

    def tail_first(self) -> list[bytes]:
        if not self.in_order:
            get = self.positions.get
            self.keys.sort(key=lambda k: get(k, _NO_POSITION))
            self.in_order = True
        return self.keys[::-1]

    def _head_first(self) -> list[bytes]:
        if self.in_order:
            return self.keys
        get = self.positions.get
        return sorted(self.keys, key=lambda k: get(k, _NO_POSITION))

    def __eq__(self, other: object) -> bool:  # same state (tests compare policy states)
        # tail_first() sorts lazily, in place: an unsorted group equals its sorted self
        return isinstance(other, _Group) and (self._head_first(), self.live) == (other._head_first(), other.live)

    __hash__ = object.__hash__  # sets of groups: by identity


_FINISHED = _Group({})  # every finished request's: no keys, never live
_FINISHED.live = False


class LRUPolicy(EvictionPolicy):
    name = "lru"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self._order: OrderedDict[bytes, _Group | None] = OrderedDict()  # oldest first

    def _group(self, ctx: ReqContext) -> _Group:
        """The request's group; _FINISHED (not live) once it has finished."""
        group = ctx.get_owned(self)
        if group is None:
            group = _Group(ctx.offload_key_positions())
            ctx.set_owned(self, group)
        return group

    def insert(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        group = None
        if ctx is not None and keys and keys[-1] in ctx.offload_key_positions():
            group = self._group(ctx)
            if group.live:
                group.add(keys)
            else:  # a store landing after the finish (vLLM's order): ranked on its own
                group = None
        # Reversed: the tail lands older than the head, so it goes first.
        order = self._order
        for k in reversed(keys):
            order[k] = group  # the manager inserts only keys it does not hold

    def insert_cold(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        order = self._order
        move = order.move_to_end
        for k in keys:  # head first to the old end: the tail ends up oldest
            order[k] = None
            move(k, last=False)

    def access(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        # A running request loaded these (prefix order): they rank with its
        # group from now on (newest end), as vLLM 0.33 ranks a request's
        # reads provisionally; its on_request_finished commits the use.
        if ctx is None or not keys or keys[-1] not in ctx.offload_key_positions():
            return
        group = self._group(ctx)
        if not group.live:
            return
        group.add(keys)
        order = self._order
        if _move_all(order, keys):
            for k in keys:  # (a loop: OrderedDict.update is slower)
                order[k] = group
            return
        move = order.move_to_end
        for k in reversed(keys):
            try:
                move(k)
            except KeyError:
                continue
            order[k] = group

    def touch(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        order = self._order
        if _move_all(order, keys):
            for k in keys:  # used: ranked on its own from now on
                order[k] = None
            return
        move = order.move_to_end
        for k in reversed(keys):
            try:
                move(k)
            except KeyError:
                continue
            if order[k] is not None:  # used: ranked on its own from now on
                order[k] = None

    def finished(self, ctx: ReqContext) -> None:
        # Its group dies, stored keys or not. A store may still land (vLLM finishes a
        # request in the step it submits the last one): the context keeps a shared
        # dead group, so that store opens none (a live one would keep the request's
        # key positions alive until all its keys were evicted).
        group = ctx.get_owned(self)
        if group is not _FINISHED:
            ctx.set_owned(self, _FINISHED)
            if group is not None:
                group.live = False
                group.keys = []
                group.positions = {}  # (the request's dict: not kept alive by its keys' values)

    def refresh(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        # The manager re-ranks a finished request's stores (storage: an empty refresh)
        if ctx is not None:
            self.finished(ctx)
        if _move_all(self._order, keys):
            return
        move = self._order.move_to_end
        for k in reversed(keys):
            try:
                move(k)
            except KeyError:
                pass

    def remove(self, key: bytes) -> None:
        self._order.pop(key, None)

    def evict(self, n: int, can_evict: Callable[[bytes], bool]) -> list[bytes] | None:
        if n <= 0:
            return []
        order = self._order
        if n > len(order):
            return None
        # The common case in C: the n oldest keys are loose (no live group)
        # and evictable; they go oldest first, as the loop below takes them.
        # Their values are None or a few groups: each distinct one is looked
        # at once (a set, by identity; list.count(None) would call
        # _Group.__eq__ on every group value).
        head = list(islice(order.values(), n)) if n >= BATCH_MIN else ()
        if head and all(g is None or not g.live for g in set(head)):
            victims = list(islice(order, n))
            fast = getattr(can_evict, "all", None)
            if fast(victims) if fast is not None else all(map(can_evict, victims)):
                for k in victims:
                    del order[k]
                return victims
        victims = []
        drained = None  # live groups already taken tail first
        for k, group in order.items():
            if group is None or not group.live:
                if can_evict(k):
                    victims.append(k)
                    if len(victims) == n:
                        break
                continue
            if drained is None:
                drained = set()
            elif group in drained:
                continue  # its evictable keys were taken when its oldest key came up
            drained.add(group)
            get = order.get
            taken = set()  # a key evicted and stored again is listed twice
            for k2 in group.tail_first():
                if get(k2) is group and k2 not in taken and can_evict(k2):
                    taken.add(k2)
                    victims.append(k2)
                    if len(victims) == n:
                        break
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


def _move_all(order: OrderedDict, keys: list[bytes]) -> bool:
    """Move keys to the newest end, the last of them first (the head ends
    newest), in one C loop; False if one is missing, or if there are too
    few to gain from it (the caller's loop is faster below ~64 keys). A
    caller then redoes the moves key by key: the same keys moved in the
    same order end in the same places."""
    if len(keys) < BATCH_MIN:
        return False
    try:
        deque(map(order.move_to_end, reversed(keys)), 0)
    except KeyError:
        return False
    return True
