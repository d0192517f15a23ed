"""Scheduler-side bookkeeping of the storage tier: which key holds which
slab slot, which are readable, pinned, or being written.

It starts from the persistent index (the blocks a previous process stored
are readable at once) and learns of slots the worker found corrupt through
the shared SlabStore, dropping their keys (a miss) and counting them.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Sequence

from kvoffload.abstractions import (
    BlockIDsLoadStoreSpec,
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadingStats,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)
from kvoffload.policies import get_policy_class
from kvoffload.requests import low_retention, prefix_order
from kvoffload.tiers.storage.index import MAX_KEY_BYTES
from kvoffload.tiers.storage.store import SlabStore

log = logging.getLogger(__name__)


class StorageLoadStoreSpec(BlockIDsLoadStoreSpec):
    """Slab slots, one per key in key order; a store spec also carries the
    keys (the index records them)."""

    def __init__(self, block_ids: Sequence[int], keys: list[OffloadKey] | None = None):
        super().__init__(block_ids)
        self.keys = keys


class StorageOffloadingManager(OffloadingManager):
    def __init__(self, store: SlabStore, policy: str = "lru", enable_events: bool = False,
                 name: str = "storage", medium: Medium = Medium.STORAGE,
                 locality: Locality = Locality.LOCAL):
        self.store = store
        self.name = name
        self.medium = medium
        self.locality = locality
        self.enable_events = enable_events
        n = store.num_slots
        self.policy = get_policy_class(policy)(n)
        self._slot_of: dict[OffloadKey, int] = {}
        self._key_of: dict[int, OffloadKey] = {}
        self._writing: set[OffloadKey] = set()  # prepared, not yet complete_store'd
        self._pins: dict[OffloadKey, int] = {}
        self._doomed: set[OffloadKey] = set()  # corrupt, freed once unpinned
        restored = [(slot, key) for slot, (key, _) in store.durable.items()]
        used = {slot for slot, _ in restored}
        self._free = [s for s in range(n - 1, -1, -1) if s not in used]
        for slot, key in restored:  # oldest first, so recency survives a restart
            self._slot_of[key] = slot
            self._key_of[slot] = key
        self.policy.insert([k for _, k in restored], None)
        self._events: list[OffloadingEvent] = []
        self._counters: dict[str, float] = {}
        if store.bad_index_records:  # damaged index records skipped at open
            self._count("index_bad_records", store.bad_index_records)

    # --- helpers ---

    def _count(self, name: str, n: float = 1) -> None:
        self._counters[name] = self._counters.get(name, 0) + n

    def _event(self, keys: list[OffloadKey], removed: bool) -> None:
        if self.enable_events and keys:
            self._events.append(OffloadingEvent(keys, self.medium, removed, self.locality, self.name))

    def _drop(self, key: OffloadKey) -> None:
        slot = self._slot_of.pop(key)
        del self._key_of[slot]
        self._free.append(slot)
        self._writing.discard(key)
        self._doomed.discard(key)
        if key in self.policy:
            self.policy.remove(key)

    def _drain_corrupt(self) -> None:
        for slot, counter in self.store.take_corrupt():
            key = self._key_of.get(slot)
            if key is None:
                continue
            self._count(counter)
            self._event([key], True)
            if self._pins.get(key):
                self._doomed.add(key)
            else:
                self._drop(key)

    def _readable(self, key: OffloadKey) -> bool:
        return key in self._slot_of and key not in self._writing and key not in self._doomed

    # --- OffloadingManager ---

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        self._drain_corrupt()
        held = key in self._slot_of  # an unhashable key raises here, before anything is counted
        self._count("lookups")
        if not held or key in self._doomed:
            self._count("misses")
            return LookupResult.MISS
        if key in self._writing:
            self._count("hits_pending")
            return LookupResult.HIT_PENDING
        self._count("hits")
        return LookupResult.HIT

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> StorageLoadStoreSpec:
        slots = []
        for key in keys:
            if not self._readable(key):
                raise KeyError(f"storage tier {self.name!r}: key {key!r} is not readable")
            slots.append(self._slot_of[key])
        for key in keys:
            self._pins[key] = self._pins.get(key, 0) + 1
        return StorageLoadStoreSpec(slots)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        held = [k for k in keys if k in self._slot_of and k in self.policy]
        if held and not low_retention(req_context):
            self.policy.touch(prefix_order(held, req_context), req_context)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        keys = keys if type(keys) is list else list(keys)
        if any(type(k) is not bytes for k in keys):
            for k in keys:
                hash(k)  # an unhashable key raises before any pin is released
        for key in keys:
            n = self._pins.get(key, 0) - 1
            if n > 0:
                self._pins[key] = n
                continue
            self._pins.pop(key, None)
            if key in self._doomed:
                self._drop(key)
        # loaded_blocks: counted by the worker, which knows whether the read succeeded

    def _can_evict(self, key: OffloadKey) -> bool:
        return not self._pins.get(key) and key not in self._writing

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        self._drain_corrupt()
        new = []
        seen = set()
        for key in keys:
            if key in self._slot_of or key in seen:
                continue
            if len(key) > MAX_KEY_BYTES:
                raise ValueError(f"storage tier keys hold at most {MAX_KEY_BYTES} bytes, got {len(key)}")
            seen.add(key)
            new.append(key)
        evicted: list[OffloadKey] = []
        short = len(new) - len(self._free)
        if short > 0:
            asked = set(keys)  # never evict a key this very store keeps (its copy would vanish)
            victims = self.policy.evict(short, lambda k: k not in asked and self._can_evict(k))
            if victims is None:
                self._count("allocation_failures")
                return None
            for v in victims:
                slot = self._slot_of.pop(v)
                del self._key_of[slot]
                self._free.append(slot)
            evicted = victims
            self._count("evictions", len(victims))
            self._event(victims, True)
        slots = []
        for key in new:
            slot = self._free.pop()
            self._slot_of[key] = slot
            self._key_of[slot] = key
            self._writing.add(key)
            slots.append(slot)
        return PrepareStoreOutput(new, StorageLoadStoreSpec(slots, new), evicted)

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext,
                       success: bool = True) -> None:
        done = [k for k in keys if k in self._writing]
        if not success:
            for key in done:
                self._drop(key)
            return
        for key in done:
            self._writing.discard(key)
        insert = self.policy.insert_cold if low_retention(req_context) else self.policy.insert
        insert(prefix_order(done, req_context), req_context)
        self._count("stored_blocks", len(done))
        self._count("stored_bytes", len(done) * self.store.slot_bytes)
        self._event(done, False)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        """The request's stores are all in (the tiering manager says so only
        then): the policy lets go of what it kept for the request while it ran
        (an LRU group holds the request's key positions), re-ranking nothing."""
        self.policy.refresh([], req_context)

    def take_events(self) -> Iterable[OffloadingEvent]:
        events, self._events = self._events, []
        return events

    def reset_cache(self) -> None:
        """Forget every unpinned, settled block, on disk too."""
        gone = [k for k in self._slot_of if self._can_evict(k)]
        for key in gone:
            self._drop(key)
        self._event(gone, True)
        try:
            if not self._slot_of:
                self.store.clear()
            else:
                self.store.forget([s for s in range(self.store.num_slots) if s not in self._key_of])
        except OSError as e:  # never into the engine: the blocks are forgotten here at least
            log.warning("storage tier %r: cache reset not recorded on disk (%s): its blocks may be "
                        "served again after a restart", self.name, e)

    def get_stats(self) -> OffloadingStats:
        self._drain_corrupt()
        loaded = self.store.take_loaded()
        if loaded:
            self._count("loaded_blocks", loaded)
            self._count("loaded_bytes", loaded * self.store.slot_bytes)
        counters, self._counters = self._counters, {}
        used = len(self._slot_of)
        cap = self.store.num_slots
        return OffloadingStats(
            tier=self.name, medium=self.medium, locality=self.locality, counters=counters,
            gauges={"used_blocks": used, "capacity_blocks": cap, "pinned_blocks": len(self._pins),
                    "usage": used / cap, "uncommitted_records": self.store.uncommitted},
        )

    def shutdown(self) -> None:
        self.store.close()
