"""A recency list in which a request's stored keys keep prefix order while it
runs, as vLLM 0.33 ranks them: at the rank of the request's first store,
tail before head, however many batches they arrive in.

A plain list ranks each batch at its arrival, so a running request's later
batches (its tail) outlive its first (its head): under pressure the head
goes first and what the request stored becomes unreachable (a prefix is
read from its head). Here a request's keys sit in one group, itself one
entry of the list placed at the request's first store; a later batch goes
to the group's old end, tail first. A key leaves its group when it is used
or re-ranked (touch, refresh), so on_request_finished's refresh re-ranks
the request's keys individually, as before. Keys without a position (a
caller that sets none) are ranked on their own, as in vLLM. Batches are
assumed to arrive head first (a later batch continues the prefix). Per
key: one entry in the group and one in `owner`; no per-key objects.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

_ABSENT = object()


class _Group:
    """One request's keys, head first (evicted from the tail: reversed)."""

    __slots__ = ("keys",)

    def __init__(self):
        self.keys: dict[bytes, None] = {}  # insertion-ordered; cheaper than an OrderedDict


class GroupedOrder:
    """Keys oldest first; entries are keys or groups of one request's keys."""

    __slots__ = ("order", "owner", "n")

    def __init__(self):
        self.order: OrderedDict[object, None] = OrderedDict()
        self.owner: dict[bytes, _Group] = {}  # key -> its group, for grouped keys
        self.n = 0

    def add_grouped(self, keys: list[bytes], policy: object, ctx) -> None:
        """Keys (prefix order, not held) stored by ctx's request: into its
        group, after (so evicted before) the request's earlier keys. A batch
        that continues the request continues its prefix."""
        state = ctx._state  # ReqContext's scratch dict, read directly (hot path)
        group = state.get(policy)
        if group is None:
            group = state[policy] = _Group()
        if not group.keys:  # new, or emptied since: it takes its place now
            self.order[group] = None
        group.keys.update(dict.fromkeys(keys))
        self.owner.update(dict.fromkeys(keys, group))
        self.n += len(keys)

    def ungroup(self, k: bytes) -> bool:
        """Take a grouped key out of its group (it is then held by no entry:
        the caller places it). False if k is not grouped."""
        group = self.owner.pop(k, None)
        if group is None:
            return False
        g = group.keys
        del g[k]
        if not g:
            del self.order[group]
        return True

    def ungroup_all(self, keys: list[bytes]) -> bool:
        """If keys are exactly one group's keys (a finished request's
        stores, re-ranked at once): dissolve it, keys held by no entry, and
        return True. Else change nothing and return False. C-level passes."""
        group = self.owner.get(keys[-1]) if keys else None
        if group is None or len(group.keys) != len(keys) or not all(map(group.keys.__contains__, keys)):
            return False
        del self.order[group]
        list(map(self.owner.pop, keys))
        group.keys.clear()
        return True

    def remove(self, k: bytes) -> bool:
        if self.order.pop(k, _ABSENT) is _ABSENT and not self.ungroup(k):
            return False
        self.n -= 1
        return True

    def remove_all(self, keys: list[bytes]) -> None:
        """Remove held keys (evict's victims)."""
        order, owner = self.order, self.owner
        for k in keys:
            group = owner.pop(k, None)
            if group is None:
                del order[k]
            else:
                g = group.keys
                del g[k]
                if not g:
                    del order[group]
        self.n -= len(keys)

    def pick(self, n: int, can_evict) -> list[bytes]:
        """Up to n keys with can_evict True, in eviction order."""
        out: list[bytes] = []
        if n <= 0:
            return out
        for e in self.order:
            if type(e) is bytes:
                if can_evict(e):
                    out.append(e)
                    if len(out) == n:
                        return out
            else:
                for k in reversed(e.keys):
                    if can_evict(k):
                        out.append(k)
                        if len(out) == n:
                            return out
        return out

    def __iter__(self) -> Iterator[bytes]:
        """Keys in eviction order."""
        for e in self.order:
            if type(e) is bytes:
                yield e
            else:
                yield from reversed(e.keys)

    def __contains__(self, k: object) -> bool:
        return k in self.order or k in self.owner

    def __len__(self) -> int:
        return self.n

    def _shape(self) -> list:
        return [e if type(e) is bytes else tuple(e.keys) for e in self.order]

    def __eq__(self, other: object) -> bool:  # same order and grouping (tests compare states)
        if not isinstance(other, GroupedOrder):
            return NotImplemented
        return self.n == other.n and self._shape() == other._shape()

    __hash__ = None
