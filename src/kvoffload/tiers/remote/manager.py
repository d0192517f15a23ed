"""Scheduler-side bookkeeping of the remote tier.

The server, not this process, decides what is held (other engines store,
maxmemory evicts, TTLs expire), so the manager keeps only short-lived
answers: keys known present (trusted for lookup_cache_s) or absent (for
the shorter miss_cache_s, so blocks other engines store show up soon),
keys whose existence check is in flight, and keys this process is
storing. It never waits on the network: an unknown key is queued for the
background checker and answered RETRY; a key the checker got no answer
for (server down, error reply) counts as absent for miss_cache_s; a key
still unanswered lookup_deadline_s after it was first asked is a MISS (as
is a new key while the checker has been stuck longer than that), so a
paused, slow or erring server delays a request by at most that deadline.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Collection, Iterable

from kvoffload.abstractions import (
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
    ScheduleEndContext,
)
from kvoffload.requests import rest_of_prefix
from kvoffload.tiers.remote.config import RemoteConfig
from kvoffload.tiers.remote.lookup import ExistenceChecker
from kvoffload.tiers.remote.state import SharedState
from kvoffload.tiers.remote.value import KeySpace, RemoteLoadStoreSpec

PRUNE_EVERY_S = 0.02
_now = time.monotonic

HIT, MISS, HIT_PENDING, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING, LookupResult.RETRY


class RemoteOffloadingManager(OffloadingManager):
    medium = Medium.CPU
    locality = Locality.REMOTE
    checker_class = ExistenceChecker  # the Mooncake tier plugs its own batch-exists round

    def __init__(self, client, keyspace: KeySpace, cfg: RemoteConfig, state: SharedState,
                 name: str = "remote", enable_events: bool = False):
        self.name = name
        self._client = client
        self._keyspace = keyspace
        self._cfg = cfg
        self._state = state
        # key -> monotonic expiry; insertion order is expiry order (one TTL per dict)
        self._present: OrderedDict[bytes, float] = OrderedDict()
        self._absent: OrderedDict[bytes, float] = OrderedDict()
        self._checking: dict[bytes, float] = {}  # key -> when its lookup gives up (MISS)
        self._storing: set[bytes] = set()
        self._events: list[OffloadingEvent] | None = [] if enable_events else None
        self._reconnects_seen = 0
        self._next_prune = 0.0
        # scheduler-thread counters (no lock); the worker's are in state.counters
        self._c: dict[str, float] = dict.fromkeys(
            ("lookups", "hits", "misses", "hits_pending", "retries", "lookup_timeouts"), 0)
        self._checker = self.checker_class(client, keyspace, state, cfg.lookup_coalesce_s)
        self._results, self._gone = self._checker.results, state.gone_keys
        self._n = 0

    # -- answers from the checker and the worker ------------------------
    def _drain(self) -> float:
        now = time.monotonic()
        results, gone = self._results, self._gone
        if results or gone:
            hit_exp, miss_exp = now + self._cfg.lookup_cache_s, now + self._cfg.miss_cache_s
            while results:
                key, present = results.popleft()
                self._checking.pop(key, None)
                # None (server down, or an error reply) is a miss for miss_cache_s: asking again at
                # once would give the key a fresh deadline, RETRY for as long as the server errs
                if present:
                    self._remember(self._present, key, hit_exp)
                else:
                    self._remember(self._absent, key, miss_exp)
            while gone:
                key = gone.popleft()
                self._present.pop(key, None)
                self._remember(self._absent, key, miss_exp)
        if now >= self._next_prune:  # memory only: lookups check expiry themselves
            self._next_prune = now + PRUNE_EVERY_S
            for d in (self._present, self._absent):
                while d:
                    key, exp = next(iter(d.items()))
                    if exp > now:
                        break
                    d.popitem(last=False)
        return now

    @staticmethod
    def _remember(d: OrderedDict, key: bytes, expiry: float) -> None:
        d[key] = expiry
        d.move_to_end(key)

    # -- OffloadingManager ----------------------------------------------
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        storing = key in self._storing  # first: an unhashable key raises before anything is counted
        self._n += 1
        if self._results or self._gone or not self._n & 127:  # hot path: skip the drain when idle
            self._drain()
        c = self._c
        c["lookups"] += 1
        if storing:
            c["hits_pending"] += 1
            return HIT_PENDING
        exp = self._present.get(key)
        if exp is not None and exp > _now():
            c["hits"] += 1
            return HIT
        exp = self._absent.get(key)
        if exp is not None and exp > _now():
            c["misses"] += 1
            return MISS
        give_up = self._checking.get(key)
        if give_up is not None:
            if _now() < give_up:
                c["retries"] += 1
                return RETRY
            c["misses"] += 1
            c["lookup_timeouts"] += 1
            return MISS
        if not self._state.available():
            c["misses"] += 1
            return MISS
        busy = self._checker.busy_since
        if busy and _now() - busy > self._cfg.lookup_deadline_s:  # stuck server: don't queue behind it
            c["misses"] += 1
            c["lookup_timeouts"] += 1
            return MISS
        self._checking[key] = _now() + self._cfg.lookup_deadline_s
        self._checker.ask(key)
        self._ask_rest_of_prefix(key, req_context)
        c["retries"] += 1
        return RETRY

    def _ask_rest_of_prefix(self, key: OffloadKey, ctx: ReqContext) -> None:
        # Schedulers look up a prefix key by key and stop at the first
        # non-HIT, which would cost one round trip per block: check the
        # rest of the request's prefix all at once.
        rest = rest_of_prefix(key, ctx)
        if not rest:
            return
        now, present, absent = _now(), self._present, self._absent
        checking, storing, ask = self._checking, self._storing, self._checker.ask
        give_up = now + self._cfg.lookup_deadline_s
        for k in rest:
            if (present.get(k, 0.0) <= now and absent.get(k, 0.0) <= now
                    and k not in checking and k not in storing):
                checking[k] = give_up
                ask(k)

    def prefetch(self, keys: Iterable[OffloadKey]) -> None:
        """Start existence checks for keys without a fresh answer, so a
        caller that knows a request's whole prefix gets it in one round
        trip instead of one per block."""
        self._drain()
        if not self._state.available():
            return
        now = _now()
        give_up = now + self._cfg.lookup_deadline_s
        for key in keys:
            if (self._present.get(key, 0.0) <= now and self._absent.get(key, 0.0) <= now
                    and key not in self._checking and key not in self._storing):
                self._checking[key] = give_up
                self._checker.ask(key)

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> RemoteLoadStoreSpec:
        # Nothing to pin: the server may still evict; the worker then reports a miss.
        keys = list(keys)
        return RemoteLoadStoreSpec(self._keyspace.redis_keys(keys), keys)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        return  # recency is the server's business (allkeys-lru sees our GETs)

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        self._drain()
        if not self._state.available():
            # the caller counts the drop (dropped_stores); we count why
            self._c["stores_refused"] = self._c.get("stores_refused", 0) + len(keys)
            return None
        now, present = _now(), self._present
        to_store = [k for k in keys if present.get(k, 0.0) <= now and k not in self._storing]
        spec = RemoteLoadStoreSpec(self._keyspace.redis_keys(to_store), to_store)  # a bad key raises here
        self._storing.update(to_store)  # only then: else it would answer HIT_PENDING forever
        return PrepareStoreOutput(keys_to_store=to_store, store_spec=spec,
                                  evicted_keys=[])  # eviction happens on the server, unseen

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        now = self._drain()
        expiry = now + self._cfg.lookup_cache_s
        done = [k for k in keys if k in self._storing]
        self._storing.difference_update(done)
        if not success:  # counted where it failed (worker: store_failures / store_queue_full)
            return
        for k in done:
            self._absent.pop(k, None)
            self._remember(self._present, k, expiry)
        self._c["stored_blocks"] = self._c.get("stored_blocks", 0) + len(done)
        if self._events is not None and done:
            self._events.append(OffloadingEvent(keys=done, medium=self.medium, removed=False,
                                                locality=self.locality, ownership=self.name))

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._checker.flush()

    def has_pending_work(self) -> bool:
        self._drain()
        return bool(self._checking)

    def take_events(self) -> Iterable[OffloadingEvent]:
        if not self._events:
            return ()
        events, self._events = self._events, []
        return events

    def reset_cache(self) -> None:
        """Forget cached answers. The server's keys stay: other engines share them."""
        self._present.clear()
        self._absent.clear()

    def get_stats(self) -> OffloadingStats:
        self._drain()
        counters = self._state.counters.take()
        for k, v in self._c.items():
            if v:
                counters[k] = counters.get(k, 0) + v
                self._c[k] = 0
        state = self._state
        reconnects = state.reconnects
        if reconnects != self._reconnects_seen:
            counters["reconnects"] = reconnects - self._reconnects_seen
            self._reconnects_seen = reconnects
        gauges = {
            "queue_depth": len(self._checking) + self._state.worker_queue_blocks,
            "known_present": len(self._present),
            "server_up": 0.0 if state.is_down else 1.0,
        }
        return OffloadingStats(tier=self.name, medium=self.medium, locality=self.locality,
                               counters=counters, gauges=gauges)

    def shutdown(self) -> None:
        self._checker.stop()
        try:
            self._client.close()
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass
