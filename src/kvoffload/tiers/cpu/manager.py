"""Scheduler-side bookkeeping of the CPU tier: which keys hold which host-pool
slot, and whether each slot may be read or evicted.

Per slot one byte (tiers/cpu/slot_state.py: indexed key by key like a
list, set for a whole call by numpy):
    255 (PENDING)  being written: not readable, not evictable
      0            readable, evictable
     >0            readable, pinned by that many loads in flight
plus a dict key -> slot and a free list of slots. No per-block objects.
A key enters the eviction policy when its store completes, so the policy
only ever sees readable keys; pending writes can never be picked.
Pins key by key (the slow path, pins past MAX_PINS): pins.py; counters:
counters.py.

An offer (prepare_store) is answered None when none of its new keys can
have a slot now (none free, none evictable: vLLM offers it again), else
with every new key, or a head of them that the policy's admission chose
(the rest counted store_blocks_declined: vLLM never offers them again).

Recency is per request (tiers/cpu/request_record.py): what a request
loaded and stored is ranked once, when it finishes. touch() still works for
callers that use it. The per-request helpers (prefix order, retention) are
kvoffload.requests'.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Sequence

import numpy as np

from kvoffload.abstractions import (
    CPULoadStoreSpec,
    LoadStoreSpec,
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)
from kvoffload.config import ConfigError
from kvoffload.geometry import ResolvedGeometry
from kvoffload.keys import check_key, check_keys
from kvoffload.policies import DEFAULT_POLICY, get_policy_class
from kvoffload.policies.base import access_of, admission_of
from kvoffload.requests import low_retention, prefix_order
from kvoffload.tiers.cpu.counters import CPUCounters
from kvoffload.tiers.cpu.errors import BlockStateError
from kvoffload.tiers.cpu.pins import SlotPins
from kvoffload.tiers.cpu.request_record import finish_request, rank_of, record_of, sort_by
from kvoffload.tiers.cpu.reset_fence import drop_all_keys
from kvoffload.tiers.cpu.slot_state import PENDING, VECTOR_MIN, pin_all, unpin_all

_HIT, _MISS, _PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING


class CPUOffloadingManager(SlotPins, CPUCounters, OffloadingManager):
    def __init__(
        self,
        num_chunks: int,
        policy: str = DEFAULT_POLICY,
        enable_events: bool = False,
        name: str = "cpu",
        medium: Medium = Medium.CPU,
        locality: Locality = Locality.LOCAL,
        geometry: ResolvedGeometry | None = None,
    ):
        if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks <= 0:
            raise ConfigError(f"num_chunks must be a positive integer, got {num_chunks!r}")
        self.num_chunks = num_chunks
        self.name = name
        self.medium = medium
        self.locality = locality
        self.policy = get_policy_class(policy)(num_chunks)
        self._admit = admission_of(self.policy)
        self._access = access_of(self.policy)
        # The chunk size, for the *_bytes counters, once the spec resolves it (none: 0).
        self._geometry = geometry
        self._slot_of: dict[bytes, int] = {}
        self._state = bytearray(num_chunks)
        self._state_np = np.frombuffer(self._state, dtype=np.uint8)  # the same bytes, for whole calls
        self._more_pins: dict[int, int] = {}  # slot -> pins past MAX_PINS
        self._mark = np.empty(num_chunks, dtype=np.intp)  # scratch of pin_all/unpin_all
        self._free: list[int] = list(range(num_chunks - 1, -1, -1))  # pop() gives slot 0 first
        self._num_pinned = 0  # slots with state > 0
        self._num_pending = 0  # slots with state == PENDING
        self._fenced: list[int] = []  # slots of jobs a reset dropped: free at on_reset_flushed
        self._protected: set[bytes] = set()  # keys of the store being prepared
        self._can_evict = self._make_can_evict()
        self._events: list[OffloadingEvent] | None = [] if enable_events else None
        self._zero_counters()

    # ---- the spec a worker reads --------------------------------------------

    def _make_spec(self, slot_ids: list[int]) -> LoadStoreSpec:
        return CPULoadStoreSpec(slot_ids)

    # ---- lookups and loads --------------------------------------------------

    # Validation costs nothing on the hot path: only keys that pass
    # check_keys are ever stored, so a key found in _slot_of is well formed,
    # and a key that is not found is checked before the error is raised.

    def _not_held(self, keys: Collection[object], what: str) -> BlockStateError:
        check_keys(keys if isinstance(keys, (list, tuple)) else list(keys))  # TypeError first
        missing = next(k for k in keys if k not in self._slot_of)
        return BlockStateError(f"{self.name}: {what} of key {missing!r} that is not stored")

    def lookup(self, key: OffloadKey, req_context: ReqContext | None = None) -> LookupResult:
        try:  # a subscript, not .get: the hit is the common case (and a try costs nothing)
            slot = self._slot_of[key]
        except (KeyError, TypeError):  # not held, or unhashable
            if type(key) is not bytes:
                check_key(key)
            self._misses += 1
            return _MISS
        if self._state[slot] == PENDING:
            self._hits_pending += 1
            return _PENDING
        self._hits += 1
        return _HIT

    def lookup_prefix(self, keys: Sequence[OffloadKey], req_context: ReqContext | None = None):
        # lookup() key by key, in C-level passes: a request's leading hits are
        # most of the keys a replay or a scheduler ever looks up.
        try:
            slots = list(map(self._slot_of.get, keys))
        except TypeError:  # an unhashable key: raise as lookup() does, having counted nothing
            check_keys(list(keys))
            raise
        try:
            n = slots.index(None)
        except ValueError:
            n = len(slots)
        else:
            del slots[n:]
        state = self._state
        if self._num_pending and PENDING in map(state.__getitem__, slots):  # (none pending: no scan)
            n = list(map(state.__getitem__, slots)).index(PENDING)
            self._hits += n
            self._hits_pending += 1
            return n, _PENDING
        if n < len(keys) and type(keys[n]) is not bytes:
            check_key(keys[n])  # raises before anything is counted
        self._hits += n
        if n == len(keys):
            return n, None
        self._misses += 1
        return n, _MISS

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext | None = None) -> LoadStoreSpec:
        slot_of = self._slot_of
        big = len(keys) >= VECTOR_MIN and not self._more_pins
        try:
            if big:
                slots = np.fromiter(map(slot_of.__getitem__, keys), np.intp, len(keys))
            else:
                slots = list(map(slot_of.__getitem__, keys))  # C-level, ~15% faster
        except (KeyError, TypeError):
            raise self._not_held(keys, "prepare_load") from None
        rec = record_of(req_context, self)  # before pinning: a bad context raises with nothing changed
        newly_pinned = pin_all(self._state_np, self._mark, slots) if big else None
        if newly_pinned is None:
            if big:
                slots = slots.tolist()
            newly_pinned = self._pin_each(keys, slots)
        self._num_pinned += newly_pinned
        if rec is not None:
            rec.note_loaded(keys)
            if self._access is not None and not low_retention(req_context):  # running: rank with its keys
                self._access(keys if type(keys) is list else prefix_order(list(keys), req_context), req_context)
        return self._make_spec(slots)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext | None = None) -> None:
        keys = keys if type(keys) is list else list(keys)
        if keys and set(map(type, keys)) != {bytes}:
            check_keys(keys)
        if low_retention(req_context):
            return
        self.policy.touch(prefix_order(keys, req_context), req_context)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext | None = None) -> None:
        self._loaded += self._unpin(keys, "complete_load")

    def release(self, keys: Collection[OffloadKey]) -> None:
        """Unpin keys that prepare_load pinned for a copy to another tier (a
        cascade): the same as complete_load, but no load is counted, since
        nothing was served from this tier."""
        self._unpin(keys, "release")

    def _unpin(self, keys: Collection[OffloadKey], op: str) -> int:
        """complete_load's and release's unpins; how many keys."""
        slot_of = self._slot_of
        big = len(keys) >= VECTOR_MIN and not self._more_pins
        try:
            if big:
                slots = np.fromiter(map(slot_of.__getitem__, keys), np.intp, len(keys))
            else:
                slots = list(map(slot_of.__getitem__, keys))  # C-level, ~15% faster
        except (KeyError, TypeError):
            raise self._not_held(keys, op) from None
        unpinned = unpin_all(self._state_np, self._mark, slots) if big else None
        if unpinned is None:
            if big:
                slots = slots.tolist()
            unpinned = self._complete_each(keys, slots, op)
        self._num_pinned -= unpinned
        return len(slots)

    # ---- stores -------------------------------------------------------------

    def _make_can_evict(self):
        # A closure over the (never rebound) containers: called once per
        # eviction candidate, cheaper than a method reading attributes.
        state, slot_of, protected = self._state, self._slot_of, self._protected

        def can_evict(key: bytes) -> bool:
            return state[slot_of[key]] == 0 and key not in protected

        def all_evictable(keys: list[bytes]) -> bool:
            # C-level over a batch of candidates: every state 0 (falsy), none protected
            return not any(map(state.__getitem__, map(slot_of.__getitem__, keys))) and (
                not protected or protected.isdisjoint(keys))

        can_evict.all = all_evictable  # optional fast path for policies (see ARC's _pick)
        return can_evict

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext | None = None, *, offered: bool = True
    ) -> PrepareStoreOutput | None:
        """offered=False: not an engine's offer (a promotion): keys the policy
        declines are not counted store_blocks_declined (the caller answers
        them a miss)."""
        slot_of = self._slot_of
        try:
            new = [k for k in keys if k not in slot_of]
        except TypeError:  # unhashable
            check_keys(list(keys))
            raise
        if new:
            check_keys(new)
            if len(new) > 1:
                new = list(dict.fromkeys(new))  # a key listed twice gets one slot
        free = self._free
        admit = self._admit
        evicted: list[bytes] = []
        need = len(new) - len(free)
        declined = 0
        if need > 0 and (not free or self._fenced) and not self._evictable_besides(keys, new):
            # No slot free (or a reset's flush pending) and none evictable:
            # every slot is written, pinned (loads, cascades to a slow tier)
            # or this offer's own. No room now, whatever the policy: None, and
            # vLLM offers these blocks again next step. The policy's admission
            # is not asked: a prefix policy would cut the request's store for
            # good, and vLLM, given an empty answer rather than None, moves
            # past those blocks and never offers them again.
            self._allocation_failures += 1
            return None
        if need > 0 or (admit is not None and new):
            if len(new) < len(keys):  # the store's own stored keys stay
                self._protected.update([k for k in keys if k in slot_of])
            try:
                if admit is not None and new:
                    # the policy may store only a head of them (a prefix's next blocks)
                    n = admit(new, len(free), req_context, self._can_evict)
                    if n < len(new):
                        declined = len(new) - n
                        new = new[:n]
                        need = n - len(free)
                victims = self.policy.evict(need, self._can_evict) if need > 0 else []
            finally:
                self._protected.clear()
            if victims is None:
                self._allocation_failures += 1
                return None
            if offered:
                self._declined += declined  # never offered again: the policy's choice, counted
        if need > 0:
            evicted = victims
            free.extend(map(slot_of.pop, victims))  # their state is 0 already: can_evict said so
            self._evictions += len(victims)
            if self._events is not None:
                self._events.append(OffloadingEvent(list(victims), self.medium, True, self.locality))
        state = self._state
        cut = len(free) - len(new)
        slots = free[cut:]
        del free[cut:]
        slots.reverse()  # lowest slot to the first key, as free.pop() would
        slot_of.update(zip(new, slots))
        for s in slots:
            state[s] = PENDING
        self._num_pending += len(new)
        if req_context is not None and not req_context.offload_key_positions():
            rec = record_of(req_context, self)
            if rec is not None:
                rec.note_prepared(new)
        return PrepareStoreOutput(keys_to_store=new, store_spec=self._make_spec(slots), evicted_keys=evicted)

    def _evictable_besides(self, keys: Collection[OffloadKey], new: list[OffloadKey]) -> int:
        """How many held keys a store of `keys` could evict: readable and
        unpinned, the offer's own held keys (which it keeps) excepted."""
        n = len(self._slot_of) - self._num_pinned - self._num_pending
        if n > 0 and len(new) < len(keys):
            slot_of, state = self._slot_of, self._state
            own = {k for k in keys if k in slot_of}
            n -= sum(1 for k in own if not state[slot_of[k]])
        return n

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext | None = None, success: bool = True
    ) -> None:
        if not keys:
            return
        if req_context is not None and not isinstance(req_context, ReqContext):  # read after the slots change
            raise TypeError(f"{self.name}: complete_store's req_context must be a ReqContext or None, "
                            f"got {type(req_context).__name__}")
        slot_of, state = self._slot_of, self._state
        try:
            slots = list(map(slot_of.__getitem__, keys))  # C-level, ~15% faster
        except (KeyError, TypeError):
            check_keys(list(keys))
            missing = next(k for k in keys if k not in slot_of)
            raise BlockStateError(f"{self.name}: complete_store of key {missing!r} that was never prepared") from None
        values = list(map(state.__getitem__, slots))
        if min(values) == PENDING:  # all pending: the usual case
            pending = list(keys)
        else:
            pending = [k for k, v in zip(keys, values) if v == PENDING]
            if not pending:
                raise BlockStateError(
                    f"{self.name}: complete_store of keys with no store in flight "
                    f"(already completed?), first {next(iter(keys))!r}"
                )
            slots = [slot_of[k] for k in pending]
        if len(pending) > 1 and type(keys) is not set:
            n = len(pending)
            pending = list(dict.fromkeys(pending))
            if len(pending) < n:
                slots = [slot_of[k] for k in pending]
        self._num_pending -= len(pending)
        if success:
            for s in slots:
                state[s] = 0
            rank = rank_of(req_context, self)  # key positions, else the prepare order
            ordered = pending if rank is None or len(pending) < 2 else sort_by(pending, rank)
            rec = record_of(req_context, self)
            # A store may land after on_request_finished (vLLM finishes a request in the step it
            # submits its last store): the policy still gets the request, and must not open
            # per-request state for it that nothing would let go (LRU: policies/lru.py _FINISHED).
            if low_retention(req_context):
                self.policy.insert_cold(ordered, req_context)
            else:
                self.policy.insert(ordered, req_context)
            if rec is not None:
                rec.note_stored(ordered, rank)
            self._stored += len(pending)
            if self._events is not None:
                self._events.append(OffloadingEvent(pending, self.medium, False, self.locality))
        else:
            for k in pending:
                del slot_of[k]
            for s in slots:
                state[s] = 0
            self._free.extend(slots)
            self._dropped += len(pending)
            if self._events is not None:  # vLLM 0.33's event tracker drops the payload it recorded
                self._events.append(OffloadingEvent(pending, self.medium, True, self.locality, metadata_only=True))

    # ---- requests, events, stats -------------------------------------------

    def _count_bad_hints(self, n: int) -> None:
        self._bad_hints += n

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        low_retention(req_context, self._count_bad_hints)  # parsed, and a bad hint counted, at arrival
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        """Commit the request's recency (request_record.finish_request)."""
        finish_request(req_context, self, self.policy)

    def take_events(self) -> Iterable[OffloadingEvent]:
        if not self._events:
            return []
        events, self._events = self._events, []
        for i, e in enumerate(events):
            if e.metadata_only:  # a retry since may hold the key again: its cleanup is stale
                keys = [k for k in e.keys if k not in self._slot_of]
                if len(keys) < len(e.keys):
                    events[i] = dataclasses.replace(e, keys=keys)
        return [e for e in events if e.keys]

    def reset_cache(self) -> None:
        """Drop every key and the policy's history (ARC ghosts and target);
        slots of jobs in flight are fenced until on_reset_flushed (reset_fence.py)."""
        removed = drop_all_keys(self._slot_of, self._state, self._free, self._fenced)
        self._num_pinned = self._num_pending = 0
        self._more_pins.clear()
        self.policy = type(self.policy)(self.num_chunks)
        self._admit = admission_of(self.policy)
        self._access = access_of(self.policy)
        if removed and self._events is not None:
            self._events.append(OffloadingEvent(removed, self.medium, True, self.locality))

    def on_reset_flushed(self) -> None:
        """The workers finished every job in flight at the earlier resets:
        their fenced slots are free."""
        self._free.extend(self._fenced)
        self._fenced.clear()

    def awaiting_flush(self) -> bool:
        """True while slots of jobs dropped by a reset are held back."""
        return bool(self._fenced)

    release_fenced_slots = on_reset_flushed  # (see TieringManager.release_fenced_slots)

    # ---- introspection (tests, tiers built on this one) ---------------------

    @property
    def chunk_bytes(self) -> int:
        """KV bytes of one chunk, once known (0 until then)."""
        return 0 if self._geometry is None else self._geometry.chunk_bytes

    def __len__(self) -> int:
        """Keys held, pending writes included."""
        return len(self._slot_of)

    def __contains__(self, key: object) -> bool:
        return key in self._slot_of

    def room(self, keys: Collection[OffloadKey] = ()) -> int:
        """Slots a store of `keys` could have now: free ones and those of
        readable, unpinned keys (if the policy lets them go), less those of
        the keys it holds already (a store keeps its own)."""
        keys = keys if type(keys) is list else list(keys)
        return len(self._free) + self._evictable_besides(keys, [k for k in keys if k not in self._slot_of])

    def slot_of(self, key: OffloadKey) -> int | None:
        return self._slot_of.get(key)
