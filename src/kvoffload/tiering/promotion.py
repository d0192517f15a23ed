"""Promotions: chunks a secondary tier holds and CPU lacks, read back into
CPU slots. A secondary hit is queued per (tier, request) and answered
HIT_PENDING; on_schedule_end submits each queue as one job. Once the chunk
lands in CPU it is held for its request until the request loads it (see
RequestState.held) and the lookup is a HIT; if no CPU slot can be freed or
the read fails, a MISS (the request's `failed` set).

Promotions hold at most half of CPU (in flight and held together), so the
running requests' stores always find room: many waiting requests whose
prefixes sit below CPU would otherwise fill it with their holds.
  - A request holding nothing gets all its queued chunks at once, or waits
    (HIT_PENDING) while others hold the room: a part would hold room it
    cannot use. After PATIENCE flushes it takes a part, so it never starves.
  - When the half is full, of the requests holding some, one (the waiter)
    waits for the rest of its prefix; the others get no more (MISS) and go
    ahead with what they hold, so their room returns and the waiter's
    promotion finds it. Two holders both waiting would wait for each other.
Before both rules, partial promotions filled the half and every holder was
refused the rest: a tenth of the promoted blocks on the agentic traces."""

from __future__ import annotations

import time
from collections.abc import Callable

from kvoffload.abstractions import LookupResult, OffloadKey, ReqContext
from kvoffload.requests import rest_of_prefix
from kvoffload.tiering.jobs import JobTable
from kvoffload.tiering.state import RequestState
from kvoffload.tiering.tier import Tier
from kvoffload.tiers.cpu.manager import CPUOffloadingManager

PATIENCE = 4  # flushes a request holding nothing waits for room for all its chunks, before taking a part
_MISS, _HIT, _PENDING = LookupResult.MISS, LookupResult.HIT, LookupResult.HIT_PENDING


class Promotions:
    def __init__(self, primary: CPUOffloadingManager, tiers: list[Tier], jobs: JobTable,
                 state_of: Callable[[ReqContext], RequestState]):
        self.primary = primary
        self.tiers = tiers
        self._jobs = jobs
        self._state_of = state_of
        # (tier index, req_id) -> (ctx, keys to promote); submitted by flush()
        self._queue: dict[tuple[int, str], tuple[ReqContext, list[OffloadKey]]] = {}
        self._queued: set[OffloadKey] = set()
        self.held = False  # see TieringManager.release_fenced_slots()
        self.holding = 0  # CPU chunks promotions hold: in flight, or landed and held for a request
        self._waiter: RequestState | None = None  # the one holder that waits for room (see above)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def clear(self) -> None:
        """Drop what is queued (not submitted yet)."""
        self._queue.clear()
        self._queued.clear()
        self._waiter = None

    def drop_request(self, req_id: str) -> None:
        for qk in [qk for qk in self._queue if qk[1] == req_id]:
            _, keys = self._queue.pop(qk)
            self._queued.difference_update(keys)

    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        """A CPU miss: ask the secondary tiers the request's filter allows, in order."""
        if key in self._queued:
            return _PENDING
        if self.held:
            return _MISS
        st = self._state_of(ctx)
        if key in st.failed:
            return _MISS
        allows = ctx.load_tier_filter.allows
        for i, t in enumerate(self.tiers):
            if t.worker is None or not allows(t.medium, t.locality):
                continue
            r = t.manager.lookup(key, ctx)
            if r is _HIT:
                if self.holding >= self._cap():  # promotions hold half of CPU already
                    # one holding none waits, as the holders load theirs; of
                    # those holding some, the waiter waits, the rest go ahead
                    return _PENDING if self._may_wait(st) else _MISS
                q = self._queue.get((i, ctx.req_id))
                if q is None:
                    q = self._queue[(i, ctx.req_id)] = (ctx, [])
                q[1].append(key)
                self._queued.add(key)
                self._queue_rest_of_prefix(t, key, ctx, st, q[1])
                return _PENDING
            if r is not _MISS:
                return r  # HIT_PENDING (a write to it is landing) or RETRY
        return _MISS

    def _cap(self) -> int:
        return max(1, self.primary.num_chunks // 2)

    def _may_wait(self, st: RequestState) -> bool:
        """With promotions' room full: may this request wait for more? One
        holding nothing may; of those holding some, only the waiter, and only
        while what it holds leaves room for more (else it would wait for
        itself). The waiter's place passes on once it holds nothing."""
        mine = len(st.held) + st.promoting
        if not mine:
            return True
        w = self._waiter
        if w is not None and w is not st and (w.held or w.promoting) and not w.finished:
            return False
        if mine >= self._cap():
            return False
        self._waiter = st
        return True

    def _queue_rest_of_prefix(self, t: Tier, key: OffloadKey, ctx: ReqContext,
                              st: RequestState, queued: list[OffloadKey]) -> None:
        """Queue the chunks after `key` that this tier holds and CPU lacks, up
        to the first it does not hold: the scheduler stops at the first
        HIT_PENDING, so without this a prefix of N chunks would take N steps.
        Capped at half of CPU so a batch's promotion can still find room."""
        budget = max(0, self.primary.num_chunks // 2 - len(queued))
        slot_of = self.primary.slot_of
        for k in rest_of_prefix(key, ctx):
            if budget <= 0:
                break
            if slot_of(k) is not None or k in self._queued:
                continue  # already in (or on its way to) CPU
            if k in st.failed or t.manager.lookup(k, ctx) is not _HIT:
                break
            queued.append(k)
            self._queued.add(k)
            budget -= 1

    def flush(self) -> None:
        """Submit the queued promotions, one job per (tier, request)."""
        queue, self._queue = self._queue, {}
        self._queued.clear()
        primary = self.primary
        slot_of = primary.slot_of
        items = list(queue.items())
        if self._waiter is not None:  # the waiter's first: room that frees is its
            items.sort(key=lambda item: self._state_of(item[1][0]) is not self._waiter)
        for (i, _), (ctx, keys) in items:
            t, st = self.tiers[i], self._state_of(ctx)
            room = self._cap() - self.holding
            if room <= 0:
                if not self._may_wait(st):
                    self._failed(t, st, keys)
                continue  # else asked again by its next lookup
            if len(keys) > room and self.holding and not (st.held or st.promoting) and st.room_waits < PATIENCE:
                st.room_waits += 1  # not all of it fits while others hold: wait (a part would hold room it cannot use)
                continue
            keys = keys[:room]
            # the request's CPU hits ride along: already stored, so protected from eviction
            resident = [k for k in st.cpu_hits if slot_of(k) is not None]
            out = primary.prepare_store(resident + keys, ctx, offered=False)
            if out is None and len(keys) > 1:  # no room for the look-ahead: the first chunk alone
                keys = keys[:1]
                out = primary.prepare_store(resident + keys, ctx, offered=False)
            if out is None:  # no CPU slot can be freed
                self._failed(t, st, keys)
                continue
            taken = set(out.keys_to_store)
            # A prefix policy (hubchain, the default) may take only a head of
            # them, or none, and refuses the rest for this request: those are
            # a MISS now. Left unmarked, each lookup queued them again and the
            # request waited for them forever.
            refused = [k for k in keys if k not in taken and slot_of(k) is None]
            if refused:
                self._failed(t, st, refused)
            keys = out.keys_to_store  # (the others reached CPU meanwhile)
            if not keys:
                continue
            try:
                src = t.manager.prepare_load(keys, ctx)
            except KeyError:  # the tier's documented answer: the chunk left it since the lookup
                primary.complete_store(keys, ctx, success=False)
                self._failed(t, st, keys)
                continue
            job = self._jobs.new_id()
            if not t.worker.submit_load(job, src, out.store_spec):
                t.manager.complete_load(keys, ctx)
                primary.complete_store(keys, ctx, success=False)
                self._failed(t, st, keys)
                continue
            self._jobs.add(job, i, False, keys, ctx)
            st.jobs += 1
            if not st.promoting:
                st.promote_since = time.monotonic()
            st.promoting += len(keys)
            self.holding += len(keys)

    @staticmethod
    def _failed(t: Tier, st: RequestState, keys: list[OffloadKey]) -> None:
        st.failed.update(keys)
        t.count("promotion_failures", len(keys))
