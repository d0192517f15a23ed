"""Hypothesis state machine: the tiered manager (a real CPU manager and host
pool over a real storage tier on files) driven in vLLM's order.

The engine side is modelled: store and load jobs it submits complete later
(or fail, or never: a reset drops them), chunks on disk get corrupted (the
promotion reading one fails), requests finish before their last
stores complete, a reset's dropped stores may still write their slots
("late DMA") until on_reset_flushed(). Checked after every step:
  - every slot is held by a key, free, or fenced by a reset, exactly once;
  - CPU pending slots are exactly the engine's store jobs in flight plus the
    manager's promotions in flight; pin counts exactly the engine's loads
    plus the manager's cascades plus the promotions held for running
    requests that have not loaded them yet;
  - every readable CPU key holds its own bytes (a late write to a reused
    slot, or a promotion of wrong bytes, would show here);
  - the storage tier gets no call for a request after its
    on_request_finished, and that call once.
At the end (everything completed, flushed, finished) nothing is pinned,
pending, fenced, queued or waiting to be written down, left per request,
or answers HIT_PENDING.
"""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import hypothesis.strategies as st
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvoffload.abstractions import LookupResult, ReqContext, ScheduleEndContext
from kvoffload.keys import make_offload_key
from kvoffload.tiering import Tier, TieringManager
from kvoffload.tiers.base import Namespace
from kvoffload.tiers.host_pool import HostPool
from kvoffload.tiers.cpu.manager import CPUOffloadingManager
from kvoffload.tiers.storage.tier import StorageTier
from kvoffload.tiers.cpu.slot_state import PENDING as WRITING
from tiering_rig import LateReports

CHUNK = 4096
CPU_CHUNKS = 5
NS = Namespace(model="m", dtype="f16", layout="t", block_size=16, chunk_bytes=CHUNK)
END = ScheduleEndContext((), ())
KEYS = [make_offload_key(i.to_bytes(8, "big"), 0) for i in range(10)]
HIT, MISS, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING
picks = st.integers(0, 1000)


def pattern(k: bytes) -> np.ndarray:
    seed = int.from_bytes(k[:8], "big") + 1
    return (np.arange(seed, seed + CHUNK // 8, dtype=np.uint64) * 11400714819323198485).view(np.uint8)


class TieringMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="kvo-tiering-sm-"))
        self.pool = HostPool(CPU_CHUNKS, CHUNK)
        self.cpu = CPUOffloadingManager(CPU_CHUNKS)
        self.storage = StorageTier(str(self.dir / "kv"), 12 * CHUNK, CHUNK, NS)
        self.tier = Tier(self.storage, max_queue_depth=4)
        self.mgr = TieringManager(self.cpu, [self.tier])
        self.worker = LateReports(self.storage.get_worker(self.pool), late=False)
        self.mgr.attach_workers([self.worker])
        self.child_finished: Counter[str] = Counter()
        self._spy_child()
        self.running: dict[str, ReqContext] = {}
        self.finished: list[str] = []
        self.stores: list[tuple[ReqContext, list[bytes], list[int]]] = []  # engine jobs in flight
        self.loads: list[tuple[ReqContext, list[bytes]]] = []
        self.dropped_slots: list[int] = []  # slots of stores a reset dropped, until flushed
        self.fenced = 0
        self.fenced_by_late_jobs = 0
        self.next_req = 0
        self.cursor: dict[str, int] = {}  # request -> its next chunk to store

    def _spy_child(self) -> None:
        child = self.tier.manager
        done = self.child_finished
        for name in ("prepare_store", "prepare_load", "on_request_finished"):
            real = getattr(child, name)

            def wrapped(keys_or_ctx, *rest, _real=real, _name=name):
                ctx = rest[-1] if rest else keys_or_ctx
                if ctx is None:  # a deferred write down: the CPU tier's write-back, no request's
                    assert _name == "prepare_store", f"{_name} with no request"
                    return _real(keys_or_ctx, *rest)
                assert not done[ctx.req_id], f"{_name} for {ctx.req_id} after its on_request_finished"
                if _name == "on_request_finished":
                    done[ctx.req_id] += 1
                return _real(keys_or_ctx, *rest)

            setattr(child, name, wrapped)

    # ---- requests ---------------------------------------------------------

    @precondition(lambda self: len(self.running) < 4)
    @rule(start=st.sampled_from([0, 0, 4]))  # few prefixes: later requests find what earlier ones stored
    def new_request(self, start):
        ctx = ReqContext(f"r{self.next_req}")
        self.next_req += 1
        for pos, k in enumerate(KEYS[start:] + KEYS[:start]):
            ctx.set_offload_key_position(k, (pos + 1) * 16)
        self.mgr.on_new_request(ctx)
        self.running[ctx.req_id] = ctx

    def _pick(self, i) -> ReqContext | None:
        if not self.running:
            return None
        return list(self.running.values())[i % len(self.running)]

    @precondition(lambda self: self.running)
    @rule(i=picks)
    def finish_request(self, i):
        ctx = self._pick(i)
        if ctx is None:
            return
        self.mgr.on_request_finished(ctx)  # its stores may still be in flight
        del self.running[ctx.req_id]
        self.finished.append(ctx.req_id)

    # ---- the engine's jobs -------------------------------------------------

    @precondition(lambda self: self.running)
    @rule(i=picks, n=st.integers(1, 3))
    def lookup_and_load(self, i, n):
        """Lookups from the request's head; the HIT prefix is loaded."""
        ctx = self._pick(i)
        if ctx is None:
            return
        order = sorted(KEYS, key=ctx.get_offload_key_position)
        hits = []
        for k in order:  # up to the first key that is not a HIT, as vLLM's scheduler
            r = self.mgr.lookup(k, ctx)
            if r is not HIT:
                break
            hits.append(k)
        hits = hits[:n]
        if hits:
            self.mgr.prepare_load(hits, ctx)
            self.loads.append((ctx, hits))

    @precondition(lambda self: self.running)
    @rule(i=picks, n=st.integers(1, 3), done=st.booleans())
    def store(self, i, n, done):
        """The request's next chunks, as vLLM stores a prefix as it computes it."""
        ctx = self._pick(i)
        if ctx is None:
            return
        order = sorted(KEYS, key=ctx.get_offload_key_position)
        at = self.cursor.get(ctx.req_id, 0)
        if at >= len(order):
            return
        self.cursor[ctx.req_id] = at + n
        out = self.mgr.prepare_store(order[at:at + n], ctx)
        if out is not None and out.keys_to_store:
            self.stores.append((ctx, list(out.keys_to_store), [int(s) for s in out.store_spec.block_ids]))
            if done:  # a quick copy: completed at once
                self.complete_store(len(self.stores) - 1, True)

    @precondition(lambda self: self.running)
    @rule(i=picks)
    def prefill(self, i):
        """The request's whole remaining prefix, two chunks a step, each copy
        done at once, cascades landing in between: CPU fills and evicts."""
        for _ in range(len(KEYS)):
            self.store(i, 2, True)
            self.schedule_end(True)

    # Rules whose lists fill by thread timing (a HIT_PENDING lookup, a store
    # refused while cascades pin the CPU) return early instead of having a
    # precondition: Hypothesis needs the same draws when it replays a case.
    @rule(i=picks, success=st.booleans())
    def complete_store(self, i, success):
        if not self.stores:
            return
        ctx, keys, slots = self.stores.pop(i % len(self.stores))
        if success:  # the GPU -> CPU copy
            for k, s in zip(keys, slots):
                self.pool.chunk(s)[:] = pattern(k)
        self.mgr.complete_store(set(keys), ctx, success=success)

    @rule(i=picks)
    def complete_load(self, i):
        if not self.loads:
            return
        ctx, keys = self.loads.pop(i % len(self.loads))
        self.mgr.complete_load(set(keys), ctx)

    @rule(wait=st.booleans())
    def schedule_end(self, wait):
        self.mgr.on_schedule_end(END)
        if wait:  # and let the secondary jobs land
            self.mgr.wait_idle()

    def settle(self):
        self.schedule_end(True)

    @rule(late=st.booleans())
    def reports_come_late(self, late):
        self.worker.late = late

    @rule(i=picks)
    def corrupt_a_stored_chunk(self, i):
        """A fault on disk: the promotion reading it fails (checksum), its
        CPU slot must never become readable."""
        sm = self.tier.manager
        settled = sorted(k for k in sm._slot_of if k not in sm._writing)
        if not settled:
            return
        fd, off = self.storage.store.locate(sm._slot_of[settled[i % len(settled)]])
        junk = mmap.mmap(-1, CHUNK)  # page-aligned: the slab may be opened O_DIRECT
        junk.write(b"\xee" * CHUNK)
        os.pwritev(fd, [junk], off)
        junk.close()

    # ---- resets ---------------------------------------------------------------

    @rule(now=st.integers(0, 5), late=st.booleans())
    def reset(self, now, late):
        if now or not (self.stores or self.loads or self.running):  # a reset is rare: most draws pass
            return
        self.worker.late = late  # the jobs it waits for may be reported only after it
        pinned = {k for _, keys in self.loads for k in keys}
        self.dropped_slots += [s for _, _, slots in self.stores for s in slots]
        self.mgr.reset_cache()  # the engine drops its jobs: never completed
        self.fenced += len(pinned) + sum(len(keys) for _, keys, _ in self.stores)
        # our jobs a late report left behind held CPU slots at the reset: fenced too
        # (kept apart: which jobs finish before the reset's poll is thread timing,
        # and rule preconditions must not depend on it)
        jobs = self.mgr.jobs
        stale = [j for j in jobs if j.epoch != jobs.epoch]
        also_pinned = {k for j in stale if j.is_store for k in j.keys} - pinned
        self.fenced_by_late_jobs += len(also_pinned) + sum(len(j.keys) for j in stale if not j.is_store)
        self.cursor.clear()  # vLLM re-offloads running requests from chunk 0
        self.stores.clear()
        self.loads.clear()

    @rule()
    def late_write(self):
        """A dropped store's copy landing after the reset (garbage bytes)."""
        for s in self.dropped_slots:
            self.pool.chunk(s)[:] = 0xAB

    @rule(now=st.integers(0, 2))
    def flushed_after_a_reset(self, now):
        if now or not self.fenced:
            return
        self.flushed()

    def flushed(self):
        if self.dropped_slots:
            self.late_write()
        self.dropped_slots.clear()
        self.fenced = self.fenced_by_late_jobs = 0
        self.mgr.on_reset_flushed()

    # ---- invariants ---------------------------------------------------------

    @invariant()
    def slots_are_accounted_for(self):
        cpu = self.cpu
        held = list(cpu._slot_of.values())
        assert sorted(held + cpu._free + cpu._fenced) == list(range(CPU_CHUNKS))
        assert len(cpu._fenced) == self.fenced + self.fenced_by_late_jobs
        jobs = self.mgr.jobs  # those of an earlier epoch hold nothing in CPU any more
        promoting = [k for job in jobs if not job.is_store and job.epoch == jobs.epoch for k in job.keys]
        cascading = Counter(k for job in jobs if job.is_store and job.epoch == jobs.epoch for k in job.keys)
        pending = {k for k, s in cpu._slot_of.items() if cpu._state[s] == WRITING}
        assert pending == {k for _, keys, _ in self.stores for k in keys} | set(promoting)
        pins = Counter({k: cpu._state[s] for k, s in cpu._slot_of.items() if 0 < cpu._state[s] < WRITING})
        # promotions landed for a request, held until it loads them: running requests' only
        holds = {rid: st.held for rid, st in self.mgr._requests.items() if st.held}
        assert set(holds) <= set(self.running), "a finished request still holds promoted chunks"
        held = Counter(k for keys in holds.values() for k in keys)
        assert pins == Counter(k for _, keys in self.loads for k in keys) + cascading + held
        # promotions hold at most half of CPU: in flight (any epoch) and held
        in_flight = sum(len(job.keys) for job in jobs if not job.is_store)
        assert self.mgr.promotions.holding == in_flight + sum(held.values()) <= max(1, CPU_CHUNKS // 2)
        assert cpu._num_pinned == len(pins) and cpu._num_pending == len(pending)

    @invariant()
    def readable_keys_hold_their_bytes(self):
        for k, s in self.cpu._slot_of.items():
            if self.cpu._state[s] != WRITING:
                assert np.array_equal(self.pool.chunk(s), pattern(k)), f"slot {s} of {k!r}"

    @invariant()
    def children_hear_finished_at_most_once(self):
        assert all(n == 1 for n in self.child_finished.values())

    def teardown(self):
        try:
            for ctx, keys, slots in self.stores:
                for k, s in zip(keys, slots):
                    self.pool.chunk(s)[:] = pattern(k)
                self.mgr.complete_store(set(keys), ctx)
            for ctx, keys in self.loads:
                self.mgr.complete_load(set(keys), ctx)
            self.stores.clear()
            self.loads.clear()
            self.flushed()
            for ctx in list(self.running.values()):
                self.mgr.on_request_finished(ctx)
                self.finished.append(ctx.req_id)
            self.running.clear()
            for _ in range(3):
                self.settle()
            assert not self.mgr.has_pending_work()
            g = self.cpu.get_stats().gauges
            assert (g["pinned_blocks"], g["pending_blocks"], g["fenced_blocks"]) == (0, 0, 0)
            assert not self.mgr.num_tracked_requests() and not self.mgr.jobs and not self.mgr.promotions
            assert all(self.cpu.lookup(k) is not PENDING for k in KEYS)
            assert self.tier.in_flight == 0 and not self.tier.waiting  # nothing left to write down
            sm = self.tier.manager
            assert not sm._pins and not sm._writing
            assert all(sm.lookup(k, None) is not PENDING for k in KEYS)
            self.readable_keys_hold_their_bytes()
            # every finished request's child heard it exactly once
            assert all(self.child_finished[r] == 1 for r in self.finished), (self.finished, self.child_finished)
        finally:
            self.mgr.shutdown()
            self.pool.close()
            shutil.rmtree(self.dir, ignore_errors=True)


TestTieringManager = TieringMachine.TestCase
TestTieringManager.settings = settings(max_examples=80, stateful_step_count=50, deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow])
