"""Cascades: CPU-resident chunks written down to the secondary tiers.

A cascade pins its CPU copies (prepare_load, no request: not a use) and
prepares the tier's slots (prepare_store) until the tier's write lands
(jobs.py completes both sides).

Back-pressure. Cascades in flight are bounded two ways:
  - per tier, by its `max_queue_depth` chunks, and
  - over all tiers together, by a quarter of the CPU tier's slots
    (CPU_SHARE): pinned copies cannot be evicted, so a slow tier must never
    pin so much of CPU that the engine's stores find no room (promotions may
    hold another half: promotion.py; the last quarter is always the engine's).
What does not fit waits, never dropped on the spot: each tier keeps a FIFO
of keys to write down (Tier.waiting, at most the CPU tier's slot count).
As jobs finish (poll) the waiting keys still readable in CPU are written
down, oldest first; a key that left CPU before its turn is counted
`cascade_missed`. A full FIFO lets its oldest key go to take a new one:
`cascade_missed` if it left CPU already, else `dropped_stores` (rare: the
keys waiting and still in CPU never outnumber CPU's slots). A write the
tier's worker refuses (its own queue is full: a slow server) goes back to
the head of the FIFO, to be tried again as jobs finish. Deferred writes
are the CPU tier's write-back, owned by no request (theirs may have
finished): submitted with no request context.

Counters (per tier): cascaded_blocks (submitted), cascade_deferred (queued
to wait), cascade_missed (left CPU before their turn), dropped_stores
(let go by a full queue while still in CPU, or refused by the tier: no
slot it can free, or its store unreachable); gauge cascade_waiting.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection

from kvoffload.abstractions import CPULoadStoreSpec, OffloadKey, ReqContext
from kvoffload.tiering.jobs import JobTable
from kvoffload.tiering.state import RequestState
from kvoffload.tiering.tier import Tier
from kvoffload.tiers.cpu.errors import BlockStateError
from kvoffload.tiers.cpu.manager import CPUOffloadingManager

CPU_SHARE = 4  # cascades in flight, all tiers together, pin at most 1/CPU_SHARE of CPU's slots


class Cascades:
    def __init__(self, primary: CPUOffloadingManager, tiers: list[Tier], jobs: JobTable,
                 state_of: Callable[[ReqContext], RequestState], done: Callable[[ReqContext], bool]):
        self.primary = primary
        self.tiers = tiers
        self._jobs = jobs
        self._state_of = state_of
        self._done = done

    def cap(self) -> int:
        """Chunks all tiers' cascades may have in flight together."""
        return max(1, self.primary.num_chunks // CPU_SHARE)

    def waiting_bound(self) -> int:
        """Keys a tier's FIFO holds at most: more could not all be in CPU
        at their turn."""
        return self.primary.num_chunks

    def _room(self, t: Tier) -> int:
        total = sum(x.in_flight for x in self.tiers)
        return min(t.max_queue_depth - t.in_flight, self.cap() - total)

    def waiting(self) -> bool:
        return any(t.waiting for t in self.tiers)

    def write_down(self, i: int, keys: Collection[OffloadKey], ctx: ReqContext | None) -> None:
        """Write CPU-resident keys down to tier i: now as far as the bounds
        allow, the rest after the keys already waiting."""
        t = self.tiers[i]
        if t.worker is None or not keys:
            return
        if ctx is not None and self._done(ctx):  # its children must get no more submits: the CPU tier's write-back
            ctx = None
        if t.waiting:  # FIFO: behind those already waiting
            self._defer(t, keys)
            self._drain_tier(i, t)
            return
        room = self._room(t)
        if room >= len(keys):
            self._submit(i, keys, ctx)
            return
        keys = list(keys)
        if room > 0:
            self._submit(i, keys[:room], ctx)
            keys = keys[room:]
        self._defer(t, keys)

    def _defer(self, t: Tier, keys: Collection[OffloadKey]) -> None:
        """Queue keys to wait; a full queue lets its oldest go (the likeliest
        to have left CPU already: then missed, else dropped)."""
        waiting = t.waiting
        bound = self.waiting_bound()
        slot_of = self.primary.slot_of
        added = missed = dropped = 0
        for k in keys:
            if k in waiting:
                continue
            if len(waiting) >= bound:
                if slot_of(waiting.popitem(last=False)[0]) is None:
                    missed += 1
                else:
                    dropped += 1
            waiting[k] = None
            added += 1
        t.count("cascade_deferred", added)
        if missed:
            t.count("cascade_missed", missed)
        if dropped:
            t.count("dropped_stores", dropped)

    @staticmethod
    def _retry_first(t: Tier, keys: list[OffloadKey]) -> None:
        """Keys the tier's worker refused (its queue is full): at the head of
        the FIFO, the next written down (the FIFO may pass its bound by them)."""
        waiting = t.waiting
        for k in reversed(keys):
            waiting[k] = None
            waiting.move_to_end(k, last=False)
        t.count("cascade_deferred", len(keys))

    def drain(self) -> None:
        """Write down waiting keys, as far as the bounds allow (after jobs finished)."""
        for i, t in enumerate(self.tiers):
            if t.waiting and t.worker is not None:
                self._drain_tier(i, t)

    def _drain_tier(self, i: int, t: Tier) -> None:
        room = self._room(t)
        if room <= 0:
            return
        waiting: OrderedDict[OffloadKey, None] = t.waiting
        slot_of = self.primary.slot_of
        batch, missed = [], 0
        while waiting and len(batch) < room:
            k = waiting.popitem(last=False)[0]
            if slot_of(k) is None:
                missed += 1  # evicted from CPU before its turn
            else:
                batch.append(k)
        if batch:
            missed += len(batch) - self._submit(i, batch, None)
        if missed:
            t.count("cascade_missed", missed)

    def clear(self) -> None:
        """A reset: CPU forgot the keys waiting (counted missed)."""
        for t in self.tiers:
            if t.waiting:
                t.count("cascade_missed", len(t.waiting))
                t.waiting.clear()

    def _pin_readable(self, keys: Collection[OffloadKey]) -> list[OffloadKey]:
        """Pin (prepare_load) the keys readable in CPU for a copy down; returns
        them. No request context: a copy down is not a load by the request
        (its policy must not see a use, and `release` counts no load)."""
        slot_of = self.primary.slot_of
        cand = [k for k in dict.fromkeys(keys) if slot_of(k) is not None]
        if not cand:
            return cand
        try:  # one call in the common case; the CPU tier has no "readable" query
            self.primary.prepare_load(cand, None)
            return cand
        except BlockStateError:  # some still being written (nothing pinned): pin the others one by one
            pinned = []
            for k in cand:
                try:
                    self.primary.prepare_load([k], None)
                    pinned.append(k)
                except BlockStateError:
                    pass
            return pinned

    def _submit(self, i: int, keys: Collection[OffloadKey], ctx: ReqContext | None) -> int:
        """One job writing the keys readable in CPU down to tier i; how many
        keys were readable (a pending one is written down when its store
        completes; the counters say what happened to the readable ones)."""
        t = self.tiers[i]
        pinned = self._pin_readable(keys)
        if not pinned:
            return 0
        out = t.manager.prepare_store(pinned, ctx)
        to_store = out.keys_to_store if out is not None else []
        if out is None:
            t.count("dropped_stores", len(pinned))
        if len(to_store) < len(pinned):
            keep = set(to_store)
            self.primary.release([k for k in pinned if k not in keep])
        if not to_store:
            return len(pinned)
        slot_of = self.primary.slot_of
        src = CPULoadStoreSpec([slot_of(k) for k in to_store])
        job = self._jobs.new_id()
        if not t.worker.submit_store(job, src, out.store_spec):
            t.manager.complete_store(to_store, ctx, success=False)
            self.primary.release(to_store)
            self._retry_first(t, to_store)
            return len(pinned)
        self._jobs.add(job, i, True, to_store, ctx)
        t.in_flight += len(to_store)
        t.count("cascaded_blocks", len(to_store))
        if ctx is not None:
            self._state_of(ctx).jobs += 1
        return len(pinned)
