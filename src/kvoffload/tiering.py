"""Composing a primary CPU tier with ordered secondary tiers (storage, remote).

Stores:  GPU -> CPU (the engine's jobs), then, once a chunk is readable in
         CPU, a cascade CPU -> each secondary tier (the CPU copy stays pinned
         until the tier's write lands). Slow tiers are protected by
         - admission: a chunk goes to a tier only once it was offered (stored
           or reused) `store_threshold` times, and
         - back-pressure: while a tier has `max_queue_depth` chunks in
           flight, further stores to it are dropped (counted), never waited on.
Lookups: a CPU miss asks the secondary tiers the request's TierFilter allows,
         in order; a hit there queues a promotion into a CPU slot and answers
         HIT_PENDING; promotions are batched per (tier, request) and submitted
         in on_schedule_end. Once the chunk lands in CPU the lookup is a HIT;
         if no CPU slot can be freed or the read fails, a MISS.

The secondary workers read and write host-pool chunks, and the pool is made
by the CPU worker, so they are wired when the spec's get_worker() runs: the
scheduler-side manager and the worker live in one process (vLLM's
UniProcExecutor, or `kvoffload replay`), or, under tensor parallelism through
the vLLM plugin, the secondary workers run beside the manager on the ranks'
shared host pool (integrations/vllm). Completions are polled in
on_schedule_end(), has_pending_work() and get_stats().
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

from kvoffload.abstractions import (
    CanonicalKVCaches,
    CPULoadStoreSpec,
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    OffloadingStats,
    OffloadingWorker,
    OffloadKey,
    OffloadPolicy,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from kvoffload.config import ConfigError, OffloadingConfig, check_known_keys, positive_int
from kvoffload.hints import COUNTER as BAD_HINTS
from kvoffload.hints import request_hints
from kvoffload.layout import parallel_layout_id
from kvoffload.redact import redact
from kvoffload.registry import load_class
from kvoffload.tiers.base import Namespace, SecondaryTier, TierWorker, align_up
from kvoffload.tiers.cpu.manager import CPUOffloadingManager
from kvoffload.tiers.cpu.spec import CPUOffloadingSpec

_MISS, _HIT, _PENDING, _RETRY = (LookupResult.MISS, LookupResult.HIT,
                                 LookupResult.HIT_PENDING, LookupResult.RETRY)
_DONE = object()  # in a ReqContext's scratch state: its children heard on_request_finished

# ---- secondary tier types ---------------------------------------------------

# type name -> "module:Class" of a SecondaryTier with a classmethod
# from_config(conf: dict, ctx: TierContext); imported on first use.
_TIER_TYPES: dict[str, str] = {
    "storage": "kvoffload.tiers.storage.tier:StorageTier",
    "redis": "kvoffload.tiers.remote.tier:RemoteTier",
    "mooncake": "kvoffload.tiers.mooncake.tier:MooncakeTier",
}

# keys of a secondary_tiers entry that the composing manager reads itself
TIER_KEYS = ("type", "name", "store_threshold", "max_queue_depth")
DEFAULT_STORE_THRESHOLD = 1
DEFAULT_MAX_QUEUE_DEPTH = 256  # chunks in flight per tier


@dataclass(frozen=True)
class TierContext:
    """What a tier type is built with besides its own config entry."""

    index: int  # position in secondary_tiers (for error messages)
    name: str  # unique name; also the `ownership` of its events
    namespace: Namespace
    chunk_bytes: int  # host-pool slot size (4 KiB aligned): one chunk per key
    enable_events: bool


def register_tier_type(name: str, target: str | type[SecondaryTier]) -> None:
    """Register a secondary tier type by name (a class or "module:Class")."""
    if isinstance(target, type):
        target = f"{target.__module__}:{target.__qualname__}"
    _TIER_TYPES[name] = target


def tier_type_names() -> list[str]:
    return sorted(_TIER_TYPES)


def get_tier_class(name: str) -> type[SecondaryTier]:
    return load_class(name, _TIER_TYPES, SecondaryTier, "secondary tier type", "types")


# ---- the composing manager --------------------------------------------------


@dataclass
class Tier:
    """One secondary tier as the composing manager drives it."""

    tier: SecondaryTier
    store_threshold: int = DEFAULT_STORE_THRESHOLD
    max_queue_depth: int = DEFAULT_MAX_QUEUE_DEPTH
    worker: TierWorker | None = None
    in_flight: int = 0  # chunks of store jobs not finished yet
    counters: dict[str, float] = field(default_factory=dict)

    def __post_init__(self):
        self.name = self.tier.name
        self.medium = self.tier.medium
        self.locality = self.tier.locality
        self.manager: OffloadingManager = self.tier.get_manager()

    def count(self, name: str, n: float = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n


@dataclass
class _RequestState:
    """The composing manager's view of one request."""

    request_level: list[bool]  # per tier: wants already-resident chunks too
    failed: set[OffloadKey] = field(default_factory=set)  # promotions that failed: MISS
    # keys it found readable in CPU: its promotions must not evict them, or a
    # prefix longer than what CPU can spare would never be resident at once
    cpu_hits: dict[OffloadKey, None] = field(default_factory=dict)
    jobs: int = 0  # secondary jobs in flight for this request
    # primary (GPU -> CPU) store jobs in flight: each may cascade when it
    # completes, so the children hear on_request_finished only after the last
    stores: int = 0
    ctx: ReqContext | None = None  # set with the first store (a reset may finish it)
    finished: bool = False
    # the request's keys in prefix order (from the scheduler's key positions),
    # so one secondary hit can queue the rest of the prefix in the same step
    order: list[OffloadKey] = field(default_factory=list)
    index: dict[OffloadKey, int] = field(default_factory=dict)

    def later_keys(self, key: OffloadKey, ctx: ReqContext) -> list[OffloadKey]:
        positions = ctx._offload_key_positions
        if len(self.order) != len(positions):
            self.order = sorted(positions, key=positions.__getitem__)
            self.index = {k: i for i, k in enumerate(self.order)}
        i = self.index.get(key)
        return [] if i is None else self.order[i + 1:]


class TieringManager(OffloadingManager):
    def __init__(self, primary: CPUOffloadingManager, tiers: list[Tier], name: str = "tiered",
                 max_tracked_offers: int = 1 << 20):
        self.primary = primary
        self.tiers = tiers
        self.name = name
        self._requests: dict[str, _RequestState] = {}
        # (tier index, req_id) -> (ctx, keys to promote); flushed in on_schedule_end
        self._promote_queue: dict[tuple[int, str], tuple[ReqContext, list[OffloadKey]]] = {}
        self._queued: set[OffloadKey] = set()
        # job id -> (tier index, is_store, keys, ctx)
        self._jobs: dict[int, tuple[int, bool, list[OffloadKey], ReqContext]] = {}
        self._next_job = 1
        self._offers: dict[OffloadKey, int] = {}
        self._count_offers = any(t.store_threshold > 1 for t in tiers)
        self._max_tracked_offers = max_tracked_offers
        self._counters: dict[str, float] = {}
        self._promotions_held = False  # see release_fenced_slots()

    def attach_workers(self, workers: list[TierWorker]) -> None:
        for t, w in zip(self.tiers, workers, strict=True):
            t.worker = w

    def _count(self, name: str, n: float = 1) -> None:
        self._counters[name] = self._counters.get(name, 0) + n

    def _state(self, ctx: ReqContext) -> _RequestState:
        st = self._requests.get(ctx.req_id)
        if st is None:
            st = _RequestState([False] * len(self.tiers))
            if ctx._state.get(self) is not _DONE:  # a request we were not told about: defaults
                self._requests[ctx.req_id] = st
            # else finished and its children told: a throwaway, never kept
        return st

    def _done(self, ctx: ReqContext) -> bool:
        """True once the children heard on_request_finished for this request."""
        return ctx._state.get(self) is _DONE

    def _maybe_finish(self, ctx: ReqContext, st: _RequestState) -> None:
        """Tell the children a finished request is finished, once no child
        submit call can come for it any more: no primary store left to
        complete (a completion cascades) and no secondary job in flight."""
        if st.finished and not st.stores and not st.jobs:
            self._requests.pop(ctx.req_id, None)
            ctx._state[self] = _DONE
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
        self._requests[req_context.req_id] = _RequestState(levels)
        if any(levels):
            policy = OffloadPolicy.REQUEST_LEVEL
        return RequestOffloadingContext(policy)

    def on_request_finished(self, req_context: ReqContext) -> None:
        self.primary.on_request_finished(req_context)
        for key in [k for k in self._promote_queue if k[1] == req_context.req_id]:
            _, keys = self._promote_queue.pop(key)
            self._queued.difference_update(keys)
        if self._done(req_context):
            return  # told twice: the children heard it once already
        st = self._requests.get(req_context.req_id)
        if st is None:
            st = _RequestState([False] * len(self.tiers))
        st.finished = True  # the children hear of it once its stores and jobs land
        self._maybe_finish(req_context, st)

    # ---- lookups and promotions --------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        r = self.primary.lookup(key, req_context)  # raises on a malformed key: count nothing before
        self._count("lookups")
        if self.tiers:
            if r is _MISS:
                r = self._lookup_secondary(key, req_context)
            elif r is _HIT:
                self._state(req_context).cpu_hits[key] = None
        self._count({_HIT: "hits", _MISS: "misses", _PENDING: "hits_pending", _RETRY: "retries"}[r])
        return r

    def _lookup_secondary(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        if key in self._queued:
            return _PENDING
        if self._promotions_held:
            return _MISS
        st = self._state(ctx)
        if key in st.failed:
            return _MISS
        allows = ctx.load_tier_filter.allows
        for i, t in enumerate(self.tiers):
            if t.worker is None or not allows(t.medium, t.locality):
                continue
            r = t.manager.lookup(key, ctx)
            if r is _HIT:
                q = self._promote_queue.get((i, ctx.req_id))
                if q is None:
                    q = self._promote_queue[(i, ctx.req_id)] = (ctx, [])
                q[1].append(key)
                self._queued.add(key)
                self._queue_rest_of_prefix(i, t, key, ctx, st, q[1])
                return _PENDING
            if r is not _MISS:
                return r  # HIT_PENDING (a write to it is landing) or RETRY
        return _MISS

    def _queue_rest_of_prefix(self, i: int, t: Tier, key: OffloadKey, ctx: ReqContext,
                              st: _RequestState, queued: list[OffloadKey]) -> None:
        """Queue the blocks after `key` that this tier holds and CPU lacks, up to
        the first it does not hold: the scheduler stops at the first
        HIT_PENDING, so without this a prefix of N blocks would take N steps.
        Capped at half of CPU so a batch's promotion can still find room."""
        budget = max(0, self.primary.num_chunks // 2 - len(queued))
        slot_of = self.primary.slot_of
        for k in st.later_keys(key, ctx):
            if budget <= 0:
                break
            if slot_of(k) is not None or k in self._queued:
                continue  # already in (or on its way to) CPU
            if k in st.failed or t.manager.lookup(k, ctx) is not _HIT:
                break
            queued.append(k)
            self._queued.add(k)
            budget -= 1

    def _flush_promotions(self) -> None:
        queue, self._promote_queue = self._promote_queue, {}
        self._queued.clear()
        for (i, _), (ctx, keys) in queue.items():
            t, st = self.tiers[i], self._state(ctx)
            # the request's CPU hits ride along: already stored, so protected from eviction
            slot_of = self.primary.slot_of
            resident = [k for k in st.cpu_hits if slot_of(k) is not None]
            out = self.primary.prepare_store(resident + keys, ctx)
            if out is None and len(keys) > 1:  # no room for the look-ahead: the first block alone
                keys = keys[:1]
                out = self.primary.prepare_store(resident + keys, ctx)
            if out is None:  # no CPU slot can be freed
                st.failed.update(keys)
                t.count("promotion_failures", len(keys))
                continue
            keys = out.keys_to_store  # others reached CPU meanwhile
            if not keys:
                continue
            try:
                src = t.manager.prepare_load(keys, ctx)
            except KeyError:  # left the tier since the lookup
                self.primary.complete_store(keys, ctx, success=False)
                st.failed.update(keys)
                t.count("promotion_failures", len(keys))
                continue
            job = self._next_job
            self._next_job += 1
            if not t.worker.submit_load(job, src, out.store_spec):
                t.manager.complete_load(keys, ctx)
                self.primary.complete_store(keys, ctx, success=False)
                st.failed.update(keys)
                t.count("promotion_failures", len(keys))
                continue
            self._jobs[job] = (i, False, keys, ctx)
            st.jobs += 1

    # ---- loads (CPU -> GPU: the primary's) ---------------------------------

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext):
        return self.primary.prepare_load(keys, req_context)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.primary.complete_load(keys, req_context)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.primary.touch(keys, req_context)
        for t in self.tiers:
            t.manager.touch(keys, req_context)
        if self._count_offers:
            # reuse counts as an offer: a chunk that reaches a tier's
            # threshold while resident in CPU is written down now
            reached = self._offer(keys)
            for i, t in enumerate(self.tiers):
                ks = reached.get(t.store_threshold)
                if ks:
                    self._cascade(i, ks, req_context)

    def _offer(self, keys: Collection[OffloadKey]) -> dict[int, list[OffloadKey]]:
        """Count one offer per key; returns count -> keys that just reached it."""
        offers = self._offers
        if len(offers) > self._max_tracked_offers:
            offers.clear()  # bounded memory: forget old counts wholesale
        reached: dict[int, list[OffloadKey]] = {}
        for k in dict.fromkeys(keys):
            n = offers.get(k, 0) + 1
            offers[k] = n
            reached.setdefault(n, []).append(k)
        return reached

    # ---- stores ---------------------------------------------------------------

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        out = self.primary.prepare_store(keys, req_context)
        if out is None:
            return None  # refused: not an offer, and nothing will complete
        if self._count_offers:
            self._offer(keys)
        st = self._requests.get(req_context.req_id)
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

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext,
                       success: bool = True) -> None:
        self.primary.complete_store(keys, req_context, success)
        st = self._requests.get(req_context.req_id)
        if st is not None and st.stores:
            st.stores -= 1
        if success:
            self._cascade_stored(keys, req_context)
        if st is not None and st.finished:
            self._maybe_finish(req_context, st)

    def _cascade_stored(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        for i, t in enumerate(self.tiers):
            if t.store_threshold <= 1:
                self._cascade(i, keys, req_context)
            else:
                offers = self._offers
                ks = [k for k in keys if offers.get(k, 0) >= t.store_threshold]
                if ks:
                    self._cascade(i, ks, req_context)

    def _pin_readable(self, keys: Collection[OffloadKey], ctx: ReqContext) -> list[OffloadKey]:
        """Pin (prepare_load) the keys readable in CPU; returns them."""
        slot_of = self.primary.slot_of
        cand = [k for k in dict.fromkeys(keys) if slot_of(k) is not None]
        if not cand:
            return cand
        try:
            self.primary.prepare_load(cand, ctx)
            return cand
        except KeyError:  # some still being written: pin the others one by one
            pinned = []
            for k in cand:
                try:
                    self.primary.prepare_load([k], ctx)
                    pinned.append(k)
                except KeyError:
                    pass
            return pinned

    def _cascade(self, i: int, keys: Collection[OffloadKey], ctx: ReqContext) -> None:
        """Write CPU-resident keys down to tier i (if it admits them now)."""
        t = self.tiers[i]
        if t.worker is None or not keys or self._done(ctx):
            return  # (a finished request's children must get no more submits)
        if t.in_flight + len(keys) > t.max_queue_depth:
            t.count("dropped_stores", len(keys))  # the tier is behind: shed, don't stall
            return
        pinned = self._pin_readable(keys, ctx)
        if not pinned:
            return
        out = t.manager.prepare_store(pinned, ctx)
        to_store = out.keys_to_store if out is not None else []
        if out is None:
            t.count("dropped_stores", len(pinned))
        if len(to_store) < len(pinned):
            keep = set(to_store)
            self.primary.complete_load([k for k in pinned if k not in keep], ctx)
        if not to_store:
            return
        slot_of = self.primary.slot_of
        src = CPULoadStoreSpec([slot_of(k) for k in to_store])
        job = self._next_job
        self._next_job += 1
        if not t.worker.submit_store(job, src, out.store_spec):
            t.manager.complete_store(to_store, ctx, success=False)
            self.primary.complete_load(to_store, ctx)
            t.count("dropped_stores", len(to_store))
            return
        self._jobs[job] = (i, True, to_store, ctx)
        t.in_flight += len(to_store)
        t.count("cascaded_blocks", len(to_store))
        self._state(ctx).jobs += 1

    # ---- job completions ----------------------------------------------------

    def poll(self) -> None:
        """Apply the secondary workers' finished jobs."""
        for t in self.tiers:
            if t.worker is None:
                continue
            for res in t.worker.get_finished():
                job = self._jobs.pop(res.job_id, None)
                if job is None:
                    continue
                _, is_store, keys, ctx = job
                if is_store:
                    t.manager.complete_store(keys, ctx, success=res.success)
                    self.primary.complete_load(keys, ctx)  # unpin the CPU copies
                    t.in_flight -= len(keys)
                    if not res.success:
                        t.count("failed_stores", len(keys))
                else:
                    t.manager.complete_load(keys, ctx)
                    self.primary.complete_store(keys, ctx, success=res.success)
                    t.count("promoted_blocks" if res.success else "promotion_failures", len(keys))
                st = self._requests.get(ctx.req_id)
                if st is None:
                    continue
                if not res.success and not is_store:
                    st.failed.update(keys)
                st.jobs -= 1
                self._maybe_finish(ctx, st)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self.primary.on_schedule_end(context)
        self.poll()
        if self._promote_queue:
            self._flush_promotions()
        for t in self.tiers:
            t.manager.on_schedule_end(context)

    def has_pending_work(self) -> bool:
        self.poll()
        return bool(self._jobs or self._promote_queue) or self.primary.has_pending_work() or any(
            t.manager.has_pending_work() for t in self.tiers)

    def wait_idle(self) -> None:
        """Block until every secondary job has finished, then apply them."""
        for i, t in enumerate(self.tiers):
            if t.worker is not None:
                t.worker.wait({j for j, job in self._jobs.items() if job[0] == i})
        self.poll()

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
        self.poll()
        children = [self.primary.get_stats()]
        for t in self.tiers:
            s = t.manager.get_stats() or OffloadingStats(tier=t.name, medium=t.medium, locality=t.locality)
            for k, v in t.counters.items():
                s.counters[k] = s.counters.get(k, 0) + v
            t.counters = {}
            s.gauges["queue_depth"] = t.in_flight
            children.append(s)
        counters, self._counters = self._counters, {}
        return OffloadingStats(tier=self.name, counters=counters, children=children)

    def reset_cache(self) -> None:
        """vLLM's reset contract (see CPUOffloadingManager.reset_cache): the
        engine's loads and stores in flight are dropped, never completed, and
        on_reset_flushed() follows once its workers finished them. This
        manager's own jobs (cascades reading CPU slots, promotions writing
        them) are waited for and completed here, so none touches a CPU slot
        after the reset; promotions queued but not submitted are dropped.
        Later promotions need no hold: the CPU slots an engine job dropped
        by the reset may still write are fenced, never handed out, until
        on_reset_flushed(). Requests keep their state, less the dropped
        store jobs; finished ones are finished now."""
        self.wait_idle()
        self._promote_queue.clear()
        self._queued.clear()
        self.primary.reset_cache()
        for t in self.tiers:
            t.manager.reset_cache()
        self._offers.clear()
        for st in list(self._requests.values()):
            st.stores = 0  # dropped: complete_store will not come
            st.cpu_hits.clear()
        for st in list(self._requests.values()):
            if st.finished and st.ctx is not None:
                self._maybe_finish(st.ctx, st)

    def on_reset_flushed(self) -> None:
        """The engine's workers finished every job dropped by the resets so far."""
        self.primary.on_reset_flushed()
        self._promotions_held = False

    def release_fenced_slots(self) -> None:
        """For an engine whose worker finishes a reset's dropped jobs before
        it starts any later one (vLLM 0.32) but that says nothing when: the
        fenced CPU slots are freed for its later jobs now, and promotions
        (our writes, which that order does not cover) wait, secondary hits
        answering MISS, until on_reset_flushed()."""
        self._promotions_held = True
        self._promote_queue.clear()  # not submitted yet: they would take the freed slots
        self._queued.clear()
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


# ---- the spec ---------------------------------------------------------------


class TieredOffloadingSpec(CPUOffloadingSpec):
    """The CPU spec plus `secondary_tiers` (and an optional `namespace`).

    extra_config (besides the CPU spec's keys):
      secondary_tiers: [{"type": "storage", "path": "/nvme/kv", "capacity_bytes": "64GiB",
                         "eviction_policy": "lru", "store_threshold": 1,
                         "max_queue_depth": 256}, ...]
      namespace: {"model": ..., "dtype": ..., "layout": ..., "parallel_layout": ...}
        what must match for persisted blocks to be served (block size and
        chunk bytes are added from the config; parallel_layout from the KV
        caches: "agnostic" for canonical pages, else one per TP rank)
      tp_rank, tp_size             (CPU spec keys) also pick the namespace's parallel_layout
      storage_dir, storage_bytes   shorthand for one more storage tier
      remote_url                   shorthand for one more remote tier ("mooncake" for a
                                   mooncake://HOST:PORT url, else "redis")

    The tiers are opened (directories checked, indexes read) as soon as the
    chunk size is known: at construction when kv_bytes_per_chunk /
    kv_bytes_per_token is given, else at get_worker(). Opened before the KV
    caches exist, they assume opaque per-rank pages; get_worker() reopens
    them if the pages turn out canonical (they hold nothing before then).
    """

    EXTRA_KEYS = CPUOffloadingSpec.EXTRA_KEYS + (
        "secondary_tiers", "namespace", "storage_dir", "storage_bytes", "remote_url")

    def __init__(self, config: OffloadingConfig):
        super().__init__(config)
        extra = self.extra_config
        confs = extra.get("secondary_tiers") or []
        if not isinstance(confs, list):
            raise ConfigError(f"secondary_tiers must be a list, got {redact(confs)!r}")
        confs = list(confs)
        if "storage_dir" in extra or "storage_bytes" in extra:
            if not extra.get("storage_dir") or "storage_bytes" not in extra:
                raise ConfigError("storage_dir and storage_bytes go together (a directory and its capacity)")
            confs.append({"type": "storage", "path": extra["storage_dir"],
                          "capacity_bytes": extra["storage_bytes"]})
        if extra.get("remote_url"):  # the scheme picks the tier type: mooncake://, else Redis
            url = extra["remote_url"]
            kind = "mooncake" if isinstance(url, str) and url.startswith("mooncake://") else "redis"
            confs.append({"type": kind, "url": url})
        for i, conf in enumerate(confs):
            if not isinstance(conf, dict):
                raise ConfigError(f"secondary_tiers[{i}] must be a mapping, got {redact(conf)!r}")
            if "type" not in conf:
                raise ConfigError(f"secondary_tiers[{i}]: type is required; known types: {tier_type_names()}")
            get_tier_class(conf["type"])  # unknown type: error now
        self._tier_confs = confs
        ns = self.extra_config.get("namespace") or {}
        if not isinstance(ns, dict):
            raise ConfigError(f"namespace must be a mapping, got {ns!r}")
        check_known_keys(ns, ("model", "dtype", "layout", "parallel_layout"), "namespace")
        self.namespace_fields = {k: str(v) for k, v in ns.items()}
        # until the KV caches say otherwise: pages only this rank's layout may read
        self.parallel_layout = f"tp{self.parallel.tp_size}-rank{self.parallel.tp_rank}"
        self._tiering: TieringManager | None = None
        self._tiers: list[Tier] | None = None
        if self.kv_bytes_per_chunk is not None:
            self._build_tiers()  # config errors and unusable directories surface now

    def namespace(self) -> Namespace:
        groups = ",".join(f"{g.tokens_per_block}/{g.sliding_window or 0}" for g in self.config.groups)
        fields = {"layout": f"groups={groups};tph={self.config.cache.tokens_per_hash}",
                  "parallel_layout": self.parallel_layout, **self.namespace_fields}
        return Namespace(block_size=self.config.tokens_per_chunk,
                         chunk_bytes=align_up(self.kv_bytes_per_chunk), **fields)

    def _build_tiers(self) -> list[Tier]:
        if self._tiers is not None:
            return self._tiers
        tiers, names, paths = [], set(), {}
        try:
            for i, conf in enumerate(self._tier_confs):
                cls = get_tier_class(conf["type"])
                name = str(conf.get("name", conf["type"] if conf["type"] not in names else f"{conf['type']}{i}"))
                if name in names:
                    raise ConfigError(f"secondary_tiers[{i}]: name {name!r} is used twice")
                names.add(name)
                where = f"secondary_tiers[{i}]"
                if isinstance(conf.get("path"), str):  # two tiers on one directory would fight over it
                    real = os.path.realpath(conf["path"])
                    if real in paths:
                        raise ConfigError(f"{where}.path: {conf['path']!r} is listed twice in secondary_tiers "
                                          f"(also secondary_tiers[{paths[real]}]); give each tier its own")
                    paths[real] = i
                threshold = positive_int(conf.get("store_threshold", DEFAULT_STORE_THRESHOLD),
                                         f"{where}.store_threshold")
                depth = positive_int(conf.get("max_queue_depth", DEFAULT_MAX_QUEUE_DEPTH),
                                     f"{where}.max_queue_depth")
                ctx = TierContext(i, name, self.namespace(), align_up(self.kv_bytes_per_chunk),
                                  self.kv_events_config.enable_kv_cache_events)
                tier = cls.from_config({k: v for k, v in conf.items() if k not in TIER_KEYS}, ctx)
                tiers.append(Tier(tier, threshold, depth))
        except BaseException:
            for t in tiers:  # release what was opened (fds, directory locks) so a retry can succeed
                t.manager.shutdown()
            raise
        self._tiers = tiers
        return tiers

    def get_manager(self) -> TieringManager:
        if self._tiering is None:
            primary = super().get_manager()  # raises if the chunk size is not known yet
            self._tiering = TieringManager(primary, self._build_tiers())
        return self._tiering

    def _set_parallel_layout(self, kv_caches: CanonicalKVCaches) -> None:
        """Namespace.parallel_layout from the pages this rank's pool will hold,
        so persisted opaque pages are never served to another TP layout."""
        actual = parallel_layout_id(kv_caches, self.parallel)
        given = self.namespace_fields.get("parallel_layout")
        if given is not None and given != actual:
            raise ConfigError(f"namespace.parallel_layout={given!r}, but this rank's pages are {actual!r}: "
                              "another layout would read wrong bytes; leave it out (it is derived)")
        if actual == self.parallel_layout:
            return
        self.parallel_layout = actual
        if self._tiers is not None and given is None:  # opened under the assumed layout: reopen
            for t in self._tiers:
                t.manager.shutdown()
            self._tiers = None
            tiers = self._build_tiers()
            if self._tiering is not None:  # no worker attached yet, so its tiers were never used
                self._tiering.tiers = tiers

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        self._set_parallel_layout(kv_caches)
        worker = super().get_worker(kv_caches)
        manager = self.get_manager()  # same process: the tiers need the CPU worker's pool
        manager.attach_workers([t.tier.get_worker(worker.pool) for t in manager.tiers])
        return worker
