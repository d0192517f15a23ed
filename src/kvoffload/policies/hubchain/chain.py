"""The prefix-chain base of `hubchain`: a store never breaks the chain it
reads.

A prefix cache serves a block only if every block before it on the request
is served too, so storing a deep block by evicting the head a request just
read is pure loss. The rules here:

- A store never evicts keys of its own request (its key positions).
- A store never evicts chain-order blocks used since its request began
  (their last use is at or after the request's clock: `threshold`).
- When the rest cannot make room, the store keeps a head of its new keys
  and refuses the others; every later store of that request is refused too
  (a block after a hole is useless): the request is `cut`.
- Blocks stored with kv_retention "low" go before every other block, tail
  first.

A subclass keeps its resident keys in OrderedDicts (key -> last use on a
clock counting requests, oldest first): at least `_order` (the chain order:
blocks that were hit) and `_loose` (blocks not hit yet). It names its
orders (`_orders`), picks victims (`_pick`), drops them (`_drop`), learns
from a request's first new key (`_learn`) and sees where each request
branches off its resident prefix (`_branched`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from kvoffload.abstractions import ReqContext
from kvoffload.policies.base import EvictionPolicy
from kvoffload.policies.hubchain import loops

COLD = -1  # last use of keys stored with kv_retention "low": before every other key


class Request:
    """Per-request state, kept on its ReqContext."""

    __slots__ = ("threshold", "cut", "seen", "hub")

    def __init__(self, threshold: float):
        self.threshold = threshold  # chain-order blocks used at or after it are not its victims
        self.cut = False  # a store was cut: its later stores are refused
        self.seen = False  # its first new key went to _learn
        self.hub = False  # it branches off a hub (set by the subclass)


class PrefixChain(EvictionPolicy):
    """The rules above; the orders and the pick are the subclass's."""

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self._order: OrderedDict[bytes, int] = OrderedDict()  # blocks that were hit, oldest first
        self._loose: OrderedDict[bytes, int] = OrderedDict()  # blocks not hit yet, oldest first
        self._clock = 0  # requests started (and uses outside a request)
        self._threshold = float("inf")  # of the store being prepared (admit -> evict)
        self._own: dict | None = None  # its request's key positions: never its victims
        self._picked: tuple | None = None  # (can_evict, victims) admit counted, for the evict that follows

    # ---- the subclass's part ----------------------------------------------

    def _orders(self) -> tuple[OrderedDict, ...]:
        """The orders a resident key is in (key -> last use)."""
        raise NotImplementedError

    def _learn(self, first_miss: bytes) -> None:
        """A request's first new key (its first miss)."""

    def _branched(self, req: Request, parent: bytes | None) -> None:
        """The request's store begins right after `parent` (None: no resident prefix)."""

    def _pick(self, n: int, can_evict: Callable[[bytes], bool]) -> list[bytes]:
        """Up to n victims, none of `_own`, none at or after `_threshold` in the chain order."""
        raise NotImplementedError

    def _drop(self, victims: list[bytes]) -> None:
        """Stop tracking the victims."""
        raise NotImplementedError

    # ---- admission (the manager calls it before making room) ---------------

    def admit(self, keys: list[bytes], free: int, ctx: ReqContext | None,
              can_evict: Callable[[bytes], bool]) -> int:
        """How many of `keys` (new, prefix order) to store: a head of them."""
        if ctx is None:
            self._threshold, self._own = float("inf"), None
            return len(keys)
        req = ctx.get_owned(self)
        if req is None:
            req = self._start(keys, ctx)
            ctx.set_owned(self, req)
        if req.cut:
            return 0
        if not req.seen:
            req.seen = True
            self._learn(keys[0])
        self._threshold, self._own = req.threshold, ctx.offload_key_positions()
        need = len(keys) - free
        if need <= 0:
            return len(keys)
        n = self._count_victims(need, can_evict)
        if n < need:
            req.cut = True
            return free + n
        return len(keys)

    def _start(self, keys: list[bytes], ctx: ReqContext) -> Request:
        """A request's first store: a tick of the clock, and where it branches."""
        self._clock += 1
        _, parent = self._prefix_end(keys, ctx)
        req = Request(float(self._clock))
        self._branched(req, parent)
        return req

    def _prefix_end(self, keys: list[bytes], ctx: ReqContext) -> tuple[int | None, bytes | None]:
        """(last use, key) of the deepest resident block before the store
        (loops.prefix_end: from the deep end, positions assumed in prefix
        order; C where built)."""
        return loops.prefix_end(ctx.offload_key_positions(), keys[0], self._orders())

    def _count_victims(self, need: int, can_evict: Callable[[bytes], bool]) -> int:
        # The manager's evict follows at once, for at most this many: it takes
        # a head of these (a walk for fewer victims stops earlier on the same path).
        victims = self._pick(need, can_evict)
        self._picked = (can_evict, victims)
        return len(victims)

    # ---- the EvictionPolicy contract -------------------------------------

    def insert_cold(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        self._picked = None  # any change: admit's count is stale
        loose = self._loose
        move = loose.move_to_end
        for k in keys:  # head first to the old end: the tail ends up oldest
            loose[k] = COLD
            move(k, last=False)

    def remove(self, key: bytes) -> None:
        self._picked = None  # any change: admit's count is stale
        self._order.pop(key, None)
        self._loose.pop(key, None)

    def evict(self, n: int, can_evict: Callable[[bytes], bool]) -> list[bytes] | None:
        if n <= 0:
            return []
        victims = self._victims(n, can_evict)
        if victims is None or len(victims) < n:
            return None  # nothing changed
        self._threshold, self._own = float("inf"), None  # set by admit for one store only
        self._drop(victims)
        return victims

    def _victims(self, n: int, can_evict: Callable[[bytes], bool]) -> list[bytes] | None:
        picked, self._picked = self._picked, None
        if n > len(self):
            return None
        if picked is not None and picked[0] is can_evict and len(picked[1]) >= n:
            return picked[1][:n]
        return self._pick(n, can_evict)
