"""TieringManager: a primary CPU tier composed with ordered secondary tiers
(storage, remote).

Stores:  GPU -> CPU (the engine's jobs), then, once a chunk is readable in
         CPU, a cascade CPU -> each secondary tier (the CPU copy stays pinned
         until the tier's write lands). Slow tiers are protected by
         - admission: a tier with an admission filter (admission.py)
           is written only the chunks it admits, offered when stored in CPU
           and when reused, and
         - back-pressure: cascades in flight are bounded (per tier and by a
           quarter of CPU); what does not fit waits in a per-tier FIFO,
           written down as jobs finish (cascade.py), never waited on.
         An offer is stored whole, answered None (no room now: vLLM offers
         it again), or stored in part with the rest counted:
         store_blocks_declined (the CPU policy's choice, tiers/cpu/counters.py)
         and store_blocks_cut (_store_head).
Lookups: a CPU miss asks the secondary tiers (promotion.py).

Completions of our own jobs (jobs.py) are applied in on_schedule_end() and
wait_idle() (so reset_cache() and shutdown()), and by the two queries an
idle engine still makes (_apply_finished_on_query).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Iterable

from kvoffload.abstractions import (
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    OffloadingStats,
    OffloadKey,
    OffloadPolicy,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from kvoffload.hints import COUNTER as BAD_HINTS
from kvoffload.hints import request_hints
from kvoffload.keys import check_keys
from kvoffload.tiering.cascade import Cascades
from kvoffload.tiering.jobs import Job, JobTable
from kvoffload.tiering.promotion import Promotions
from kvoffload.tiering.state import RequestState
from kvoffload.tiering.tier import Tier
from kvoffload.tiers.base import TierWorker
from kvoffload.tiers.cpu.manager import CPUOffloadingManager

log = logging.getLogger(__name__)

_MISS, _HIT, _PENDING, _RETRY = (LookupResult.MISS, LookupResult.HIT,
                                 LookupResult.HIT_PENDING, LookupResult.RETRY)
_LOOKUP_COUNTER = {_HIT: "hits", _MISS: "misses", _PENDING: "hits_pending", _RETRY: "retries"}
_DONE = object()  # on a ReqContext, under the manager: its children heard on_request_finished



class TieringManager(OffloadingManager):
    def __init__(self, primary: CPUOffloadingManager, tiers: list[Tier], name: str = "tiered",
                 promotion_deadline_s: float | None = None):
        self.primary = primary
        self.name = name
        # A request waits at most this long (s) for a promotion in flight, then its
        # lookups answer MISS and it computes. None (or 0): as long as it takes, and
        # what happens depends on no clock. The spec's default is 2 s.
        self.promotion_deadline_s = promotion_deadline_s or None
        self._requests: dict[str, RequestState] = {}
        self.jobs = JobTable()
        self._counters: dict[str, float] = {}
        self.promotions = Promotions(primary, tiers, self.jobs, self._state)
        self.cascades = Cascades(primary, tiers, self.jobs, self._state, self._done)
        self.replace_tiers(tiers)

    def replace_tiers(self, tiers: list[Tier]) -> None:
        """Use these tiers (before any worker is attached: the spec reopens
        its tiers once the KV caches' layout is known)."""
        self.tiers = tiers
        self.promotions.tiers = tiers
        self.cascades.tiers = tiers
        self._admitting = [(i, t) for i, t in enumerate(tiers) if t.admission is not None]

    def attach_workers(self, workers: list[TierWorker]) -> None:
        for t, w in zip(self.tiers, workers, strict=True):
            t.worker = w

    def tracks(self, req_id: str) -> bool:
        """True while the manager keeps state for the request (until its
        children heard on_request_finished)."""
        return req_id in self._requests

    def num_tracked_requests(self) -> int:
        return len(self._requests)

    def _count(self, name: str, n: float = 1) -> None:
        self._counters[name] = self._counters.get(name, 0) + n

    def _state(self, ctx: ReqContext) -> RequestState:
        st = self._requests.get(ctx.req_id)
        if st is None:
            st = RequestState([False] * len(self.tiers))
            if not self._done(ctx):  # a request we were not told about: defaults
                self._requests[ctx.req_id] = st
            # else finished and its children told: a throwaway, never kept
        return st

    def _done(self, ctx: ReqContext) -> bool:
        """True once the children heard on_request_finished for this request."""
        return ctx.get_owned(self) is _DONE

    def _maybe_finish(self, ctx: ReqContext, st: RequestState) -> None:
        """Tell the children a finished request is finished, once no child
        submit call can come for it any more: no primary store left to
        complete (a completion cascades) and no secondary job in flight."""
        if st.finished and not st.stores and not st.jobs:
            self._requests.pop(ctx.req_id, None)
            ctx.set_owned(self, _DONE)
            for t in self.tiers:
                t.manager.on_request_finished(ctx)

    # ---- requests -----------------------------------------------------------

    def _count_bad_hints(self, n: int) -> None:
        self._count(BAD_HINTS, n)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        # Parsed (never raising) and counted here, before the children read them.
        hints = request_hints(req_context, self._count_bad_hints)
        if hints.load_tiers is not None:  # an invalid kv_load_tiers: TierFilter.ALL
            req_context.load_tier_filter = hints.load_tiers
        policy = self.primary.on_new_request(req_context).policy
        levels = []
        for t in self.tiers:
            p = t.manager.on_new_request(req_context).policy
            levels.append(p is OffloadPolicy.REQUEST_LEVEL)
        self._requests[req_context.req_id] = RequestState(levels)
        if any(levels):
            policy = OffloadPolicy.REQUEST_LEVEL
        return RequestOffloadingContext(policy)

    def on_request_finished(self, req_context: ReqContext) -> None:
        self.primary.on_request_finished(req_context)
        self.promotions.drop_request(req_context.req_id)
        if self._done(req_context):
            return  # told twice: the children heard it once already
        st = self._requests.get(req_context.req_id)
        if st is None:
            st = RequestState([False] * len(self.tiers))
        if st.held:  # promoted for it, never loaded
            self._unhold(st, list(st.held))
        st.finished = True  # the children hear of it once its stores and jobs land
        self._maybe_finish(req_context, st)

    # ---- lookups (a CPU miss: promotion.py) ----------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        r = self.primary.lookup(key, req_context)  # raises on a malformed key: count nothing before
        self._count("lookups")
        if self.tiers:
            if r is _MISS:
                r = self.promotions.lookup(key, req_context)
            elif r is _HIT:
                self._state(req_context).cpu_hits[key] = None
            elif r is _PENDING and self.promotion_deadline_s is not None and self._overdue(req_context):
                r = _MISS  # its promotion is late: it computes instead
                self._count("promotion_timeouts")
        self._count(_LOOKUP_COUNTER[r])
        return r

    def _overdue(self, ctx: ReqContext) -> bool:
        """True if the request's oldest promotion in flight is past the deadline."""
        st = self._requests.get(ctx.req_id)
        return (st is not None and st.promoting > 0
                and time.monotonic() - st.promote_since > self.promotion_deadline_s)

    # ---- loads (CPU -> GPU: the primary's) ---------------------------------

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext):
        spec = self.primary.prepare_load(keys, req_context)
        # reuse served from CPU is reuse below too (vLLM calls no touch): their
        # recency, and an offer to their admission
        for t in self.tiers:
            t.manager.touch(keys, req_context)
        self._offer_reuse(keys, req_context)
        st = self._requests.get(req_context.req_id)
        if st is not None and st.held:  # the load pins them now: drop the promotion's hold
            self._unhold(st, [k for k in dict.fromkeys(keys) if k in st.held])
        return spec

    def _hold(self, st: RequestState, keys: list[OffloadKey]) -> None:
        """Pin promoted keys for their request (RequestState.held)."""
        self.primary.prepare_load(keys, None)
        st.held.update(dict.fromkeys(keys))
        self.promotions.holding += len(keys)

    def _unhold(self, st: RequestState, keys: list[OffloadKey]) -> None:
        for k in keys:
            del st.held[k]
        self.promotions.holding -= len(keys)
        self.primary.release(keys)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.primary.complete_load(keys, req_context)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.primary.touch(keys, req_context)
        for t in self.tiers:
            t.manager.touch(keys, req_context)
        self._offer_reuse(keys, req_context)

    def _offer_reuse(self, keys: Collection[OffloadKey], ctx: ReqContext) -> None:
        """Reuse is an offer to the tiers' admission: a chunk a tier admits
        now, while resident in CPU, is written down now."""
        if self._admitting:
            keys = list(dict.fromkeys(keys))
            for i, t in self._admitting:
                admitted = t.admission.offer(keys)
                if admitted:
                    self._cascade(i, admitted, ctx)

    # ---- stores ---------------------------------------------------------------

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        st = self._requests.get(req_context.req_id)
        if st is not None and st.held:  # it computes now: what it did not load, it never will
            check_keys(list(keys))  # a malformed key raises before any state changes
            self._unhold(st, list(st.held))  # (first: their slots may take this store)
        out = self.primary.prepare_store(keys, req_context)
        if out is None and self.tiers:
            out = self._store_head(keys, req_context)
        if out is None:
            return None  # refused: not an offer, and nothing will complete
        if self._admitting:
            offered = list(dict.fromkeys(keys))
            for _, t in self._admitting:
                t.admission.offer(offered)  # written down when admitted and stored (complete_store)
        if out.keys_to_store and not self._done(req_context):
            if st is None:
                st = self._state(req_context)
            st.stores += 1  # one complete_store will come for it
            st.ctx = req_context
        if st is not None and any(st.request_level):
            new = set(out.keys_to_store)
            resident = [k for k in keys if k not in new]
            for i, wants in enumerate(st.request_level):
                if wants and resident:
                    self._cascade(i, resident, req_context)
        return out

    def _store_head(self, keys: Collection[OffloadKey], ctx: ReqContext) -> PrepareStoreOutput | None:
        """An offer larger than CPU can take now: the head of its new keys,
        as far as there is room (its held keys ride along: kept, not
        evicted). vLLM's connector moves past every key of an answered
        offer, so the rest is never stored for this request (counted
        store_blocks_cut); but refused whole, the offer comes back next step
        with that step's blocks added, larger, and a long prompt is refused
        to its end, reaching no tier. Here the head reaches CPU and, through
        it, the tiers below. No room at all: None (offered again)."""
        primary = self.primary
        keys = list(keys)
        new = [k for k in dict.fromkeys(keys) if k not in primary]
        room = primary.room(keys)
        if not 0 < room < len(new):
            return None
        cut = set(new[room:])
        out = primary.prepare_store([k for k in keys if k not in cut], ctx)
        if out is not None:
            self._count("partial_stores")
            self._count("store_blocks_cut", len(cut))
        return out

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext,
                       success: bool = True) -> None:
        self.primary.complete_store(keys, req_context, success)
        st = self._requests.get(req_context.req_id)
        if st is not None and st.stores:
            st.stores -= 1
        if success:
            for i, t in enumerate(self.tiers):
                admission = t.admission
                self._cascade(i, keys if admission is None else [k for k in keys if admission.admitted(k)],
                              req_context)
        if st is not None and st.finished:
            self._maybe_finish(req_context, st)

    def _cascade(self, i: int, keys: Collection[OffloadKey], ctx: ReqContext) -> None:
        """Write CPU-resident keys down to tier i (cascade.py)."""
        self.cascades.write_down(i, keys, ctx)

    # ---- job completions ----------------------------------------------------

    def poll(self) -> None:
        """Apply the secondary workers' finished jobs (jobs.py)."""
        self.jobs.apply_finished(self.primary, self.tiers, self._job_done)
        self.cascades.drain()

    def _job_done(self, job: Job, success: bool) -> None:
        if job.ctx is None:  # a deferred cascade: the CPU tier's write-back, no request's
            return
        st = self._requests.get(job.ctx.req_id)
        if not job.is_store:
            self.promotions.holding -= len(job.keys)  # in flight no more
            if st is not None:
                st.promoting -= len(job.keys)
                if not success:
                    st.failed.update(job.keys)
                elif not st.finished:  # landed: held for it until it loads them
                    self._hold(st, job.keys)
        if st is None:
            return
        st.jobs -= 1
        self._maybe_finish(job.ctx, st)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self.primary.on_schedule_end(context)
        self.poll()
        if self.promotions:
            self.promotions.flush()
        for t in self.tiers:
            t.manager.on_schedule_end(context)

    def _apply_finished_on_query(self) -> None:
        """has_pending_work() and get_stats() apply finished jobs too: an
        engine stops stepping (no on_schedule_end) once no request is left,
        and vLLM 0.32 never asks has_pending_work, so a cascade landing after
        the last step would otherwise never be applied (its CPU copy never
        unpinned) nor counted; get_stats() is then the only call it makes."""
        self.poll()

    def has_pending_work(self) -> bool:
        self._apply_finished_on_query()
        return bool(self.jobs or self.promotions) or self.cascades.waiting() or self.primary.has_pending_work() or any(
            t.manager.has_pending_work() for t in self.tiers)

    def wait_idle(self) -> None:
        """Block until every secondary job has finished, then apply them
        (what a worker reports late stays in flight); while keys wait to be
        written down, again (each round writes some down). Two rounds in a
        row that change nothing (a worker holding its reports, or refusing
        writes: its queue is full) end it: what waits is written down at a
        later poll."""
        stuck, last = 0, None
        while True:
            waiting = self.cascades.waiting()
            for i, t in enumerate(self.tiers):
                if t.worker is not None:
                    t.worker.wait(self.jobs.ids_of_tier(i))
            self.poll()
            if not waiting:  # (then this poll submitted nothing new)
                return
            now = (sum(len(t.waiting) for t in self.tiers), self.jobs.added)
            stuck = stuck + 1 if now == last else 0
            if stuck >= 2:
                return
            last = now

    # ---- events, stats, lifecycle -------------------------------------------

    def take_events(self) -> Iterable[OffloadingEvent]:
        events = list(self.primary.take_events())
        for t in self.tiers:
            for e in t.manager.take_events():
                if e.ownership is None:
                    e.ownership = t.name
                events.append(e)
        return events

    def get_stats(self) -> OffloadingStats:
        self._apply_finished_on_query()
        children = [self.primary.get_stats()]
        for t in self.tiers:
            s = t.manager.get_stats() or OffloadingStats(tier=t.name, medium=t.medium, locality=t.locality)
            for k, v in t.counters.items():
                s.counters[k] = s.counters.get(k, 0) + v
            t.counters = {}
            s.gauges["queue_depth"] = t.in_flight
            s.gauges["cascade_waiting"] = len(t.waiting)
            children.append(s)
        counters, self._counters = self._counters, {}
        return OffloadingStats(tier=self.name, counters=counters, children=children)

    def reset_cache(self) -> None:
        """vLLM's reset contract (see CPUOffloadingManager.reset_cache): the
        engine's loads and stores in flight are dropped, never completed, and
        on_reset_flushed() follows once its workers finished them. This
        manager's own jobs (cascades reading CPU slots, promotions writing
        them) are waited for and completed here, so none touches a CPU slot
        after the reset (one a worker reports late is completed on its tier's
        side only: jobs.py); promotions queued but not submitted are dropped.
        Later promotions need no hold: the CPU slots an engine job dropped
        by the reset may still write are fenced, never handed out, until
        on_reset_flushed(). Requests keep their state, less the dropped
        store jobs; finished ones are finished now."""
        self.wait_idle()
        self.jobs.new_epoch()
        self.promotions.clear()
        self.cascades.clear()
        for st in self._requests.values():  # ours, read by no engine job: not to be fenced
            if st.held:
                self._unhold(st, list(st.held))
        self.primary.reset_cache()
        for t in self.tiers:
            try:
                t.manager.reset_cache()
            except Exception as e:  # one tier's failure must not skip the others nor the per-request cleanup
                log.warning("tier %r: cache reset failed: %s", t.name, e)
            if t.admission is not None:
                t.admission.clear()
        for st in list(self._requests.values()):
            st.stores = 0  # dropped: complete_store will not come
            st.cpu_hits.clear()
        for st in list(self._requests.values()):
            if st.finished and st.ctx is not None:
                self._maybe_finish(st.ctx, st)

    def on_reset_flushed(self) -> None:
        """The engine's workers finished every job dropped by the resets so far."""
        self.primary.on_reset_flushed()
        self.promotions.held = False

    def release_fenced_slots(self) -> None:
        """For an engine whose worker finishes a reset's dropped jobs before
        it starts any later one (vLLM 0.32) but that says nothing when: the
        fenced CPU slots are freed for its later jobs now, and promotions
        (our writes, which that order does not cover) wait, secondary hits
        answering MISS, until on_reset_flushed()."""
        self.promotions.held = True
        self.promotions.clear()  # not submitted yet: they would take the freed slots
        self.primary.on_reset_flushed()

    def awaiting_flush(self) -> bool:
        """True while slots of jobs dropped by a reset are held back."""
        return self.primary.awaiting_flush()

    def shutdown(self) -> None:
        self.wait_idle()
        for t in self.tiers:
            if t.worker is not None:
                t.worker.shutdown()
            t.manager.shutdown()
        self.primary.shutdown()
