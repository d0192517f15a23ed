"""`duel`: segchain or ARC, whichever a miniature simulation says wins here.

Neither expert wins everywhere: `segchain` (prefix-chain rules on LRU
recency) is LRU's equal on chat and scans and far above it on agent
contexts that outgrow the cache, while ARC's frequency split wins where
many blocks are used once (one-shot prompts, conversations that end) and
loses chat and scans. So the live cache runs one of them, chosen by set
dueling through miniature simulation (Waldspurger et al., ATC'17): two
shadow caches, one per expert, see the keys of each request whose CRC32
falls in a 1/2^k sample (k = 2..6, the smallest rate that still gives a
shadow SHADOW_MIN keys), at capacity x 2^-k, and score the leading run of
sampled keys each request finds resident (its prefix hits), decayed over
WINDOW requests. The live cache follows the better shadow (MARGIN apart),
once the shadows have turned over (WARM).

It starts with ARC: ARC needs its own history from the first eviction (T2,
ghosts, p), so a late switch to it loses what ARC would have kept, while a
switch to segchain needs only the recency order, which the live ARC keeps
(a last-use stamp per key). A switch rebuilds the other expert from the
resident keys in O(capacity): ARC's T1 = keys never hit, T2 = keys hit
(the live segchain tracks hits in a set); back, T1 is loose, T2 shielded.

Per request the shadows cost one CRC32 per key of its context and the
experts' own bookkeeping on the sampled keys; per stored or touched block,
one delegated call per batch and a C-level stamp.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from zlib import crc32
from heapq import merge
from itertools import chain, compress
from operator import itemgetter, not_

from kvoffload.abstractions import ReqContext
from kvoffload.policies.arc import ARCPolicy
from kvoffload.policies.base import EvictionPolicy
from kvoffload.policies.segchain import SegChainPolicy

SEG, ARC = 0, 1
SHADOW_MIN = 1024  # sample rate raised (up to 1/4) until a shadow holds this many keys
RATE_SHIFT = (2, 6)  # sample 1/4 .. 1/64 of the keys
WINDOW = 4096  # requests: the shadows' hits decay by 1 - 1/WINDOW per request
MARGIN = 0.002  # switch when the other shadow scores this much more (relative)
WARM = 0.25  # no switch before the shadows evicted this many times their capacity
BATCH = 16  # sampled keys per shadow store (the manager stores a request in batches too)


def _yes(key: bytes) -> bool:
    return True


class _Seg(SegChainPolicy):
    """segchain that also knows which resident keys were hit (ARC's T2 when
    the duel switches to ARC). C-level set updates per touch and eviction."""

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self._hit: set[bytes] = set()

    def touch(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        super().touch(keys, ctx)
        self._hit.update(filter(self._order.__contains__, keys))

    def remove(self, key: bytes) -> None:
        super().remove(key)
        self._hit.discard(key)

    def evict(self, n: int, can_evict: Callable[[bytes], bool]) -> list[bytes] | None:
        victims = super().evict(n, can_evict)
        if victims:
            self._hit.difference_update(victims)
        return victims


class _ARC(ARCPolicy):
    """ARC that also keeps each resident key's last use (the duel's request
    count), so a switch to segchain keeps the recency order."""

    def __init__(self, capacity: int, now: int):
        super().__init__(capacity)
        self.now = now  # the duel's request count, set as requests come
        self.last: dict[bytes, int] = {}

    def _stamp(self, keys: list[bytes]) -> None:
        # C-level; keys not (or no longer) held are stamped too and dropped
        # once the dict doubles the capacity (amortized O(1) per key)
        last = self.last
        last.update(dict.fromkeys(keys, self.now))
        if len(last) > 2 * self.capacity + 64:
            t1, t2 = self.t1, self.t2
            self.last = {k: v for k, v in last.items() if k in t1 or k in t2}

    def insert(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        super().insert(keys, ctx)
        self._stamp(keys)

    def touch(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        super().touch(keys, ctx)
        self._stamp(keys)

    def refresh(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        super().refresh(keys, ctx)
        self._stamp(keys)


class DuelPolicy(EvictionPolicy):
    name = "duel"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        shift = RATE_SHIFT[0]
        while shift < RATE_SHIFT[1] and capacity >> (shift + 1) >= SHADOW_MIN:
            shift += 1
        self._mask = (1 << shift) - 1
        self._shadow_cap = max(1, capacity >> shift)
        self._shadows = (SegChainPolicy(self._shadow_cap), ARCPolicy(self._shadow_cap))
        self._score = [0.0, 0.0]
        self._churn = 0  # keys the shadows evicted: no decision before they turned over
        self._seg = _Seg(capacity)  # kept while ARC runs: its f and reuse interval live on
        self.requests = 0  # requests seen (the clock of _ARC's last uses)
        # ARC first: it needs its history from the start (T2, ghosts, p), while
        # a switch to segchain only needs the recency order, which ARC keeps
        self.live: EvictionPolicy = _ARC(capacity, 0)
        self.mode = ARC
        self.switches = 0

    # ---- the shadows ---------------------------------------------------------

    def _observe(self, ctx: ReqContext | None) -> None:
        """A request's first call: run its sampled keys through both shadows."""
        if ctx is None or ctx.get_owned(self) is not None:
            return
        ctx.set_owned(self, True)
        self.requests += 1
        if self.mode == ARC:
            self.live.now = self.requests
        pos = ctx.offload_key_positions()
        mask = self._mask
        sample = list(compress(pos, map(not_, map(mask.__and__, map(crc32, pos)))))  # C-level
        if not sample:
            return
        sample.sort(key=pos.__getitem__)
        sctx = ReqContext("shadow")
        sctx.set_offload_key_positions(sample, [pos[k] for k in sample])
        score, keep = self._score, 1.0 - 1.0 / WINDOW
        for i, shadow in enumerate(self._shadows):
            score[i] = score[i] * keep + self._replay(shadow, sample, sctx)
        self._decide()

    def _replay(self, shadow: EvictionPolicy, keys: list[bytes], sctx: ReqContext) -> int:
        """One request on a shadow, as the manager runs it: prefix hits, stores
        of the rest in batches (admission, eviction), then the finish."""
        hits = 0
        for k in keys:
            if k not in shadow:
                break
            hits += 1
        cap = self._shadow_cap
        new = [k for k in keys[hits:] if k not in shadow]
        stored: list[bytes] = []
        admit = shadow.admit if type(shadow).admit is not EvictionPolicy.admit else None
        for b in range(0, len(new), BATCH):
            batch = new[b:b + BATCH]
            free = cap - len(shadow)
            if admit is not None:
                batch = batch[:admit(batch, max(free, 0), sctx, _yes)]
            need = len(batch) - free
            if need > 0:
                if shadow.evict(need, _yes) is None:
                    break
                self._churn += need
            if batch:
                shadow.insert(batch, sctx)
                stored += batch
        if stored:
            shadow.refresh(stored, sctx)
        if hits:
            shadow.touch(keys[:hits], sctx)
        return hits

    def _decide(self) -> None:
        if self._churn < WARM * self._shadow_cap:
            return  # a cache that has not turned over says nothing yet
        seg, arc = self._score
        if self.mode == SEG and arc > seg * (1.0 + MARGIN) + 1.0:
            self._to_arc()
        elif self.mode == ARC and seg >= arc * (1.0 + MARGIN):
            self._to_seg()

    def _to_arc(self) -> None:
        seg = self._seg
        arc = _ARC(self.capacity, self.requests)
        # T2: the keys hit since stored; T1 the rest (segchain's order holds
        # blocks of continuing chains never hit too), each oldest first
        hit = seg._hit
        every = [k for k, _ in merge(seg._loose.items(), seg._order.items(), key=itemgetter(1))]
        arc.t1 = OrderedDict.fromkeys(k for k in every if k not in hit)
        arc.t2 = OrderedDict.fromkeys(k for k in every if k in hit)
        shift = self.requests - seg._clock  # segchain's clock to request counts
        arc.last = {k: c + shift for k, c in chain(seg._loose.items(), seg._order.items())}
        shadow = self._shadows[ARC]
        arc.p = min(float(self.capacity), shadow.p * self.capacity / self._shadow_cap)
        seg._loose, seg._order, seg._hit = OrderedDict(), OrderedDict(), set()
        self.live, self.mode = arc, ARC
        self.switches += 1

    def _to_seg(self) -> None:
        arc, seg = self.live, self._seg
        # T1 loose (never hit), T2 under the shield; last uses kept as ages
        shift, last = seg._clock - self.requests, arc.last
        seg._loose = OrderedDict((k, last[k] + shift) for k in arc.t1)
        seg._order = OrderedDict((k, last[k] + shift) for k in arc.t2)
        seg._hit = set(arc.t2)
        self.live, self.mode = seg, SEG
        self.switches += 1

    # ---- the EvictionPolicy contract: the live expert's -------------------------

    def admit(self, keys: list[bytes], free: int, ctx: ReqContext | None,
              can_evict: Callable[[bytes], bool]) -> int:
        self._observe(ctx)
        if self.mode == SEG:
            return self._seg.admit(keys, free, ctx, can_evict)
        return len(keys)

    def insert(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        self.live.insert(keys, ctx)

    def insert_cold(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        self.live.insert_cold(keys, ctx)

    def touch(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        self._observe(ctx)
        self.live.touch(keys, ctx)

    def refresh(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        self.live.refresh(keys, ctx)

    def remove(self, key: bytes) -> None:
        self.live.remove(key)

    def evict(self, n: int, can_evict: Callable[[bytes], bool]) -> list[bytes] | None:
        return self.live.evict(n, can_evict)

    def __len__(self) -> int:
        return len(self.live)

    def __contains__(self, key: object) -> bool:
        return key in self.live
