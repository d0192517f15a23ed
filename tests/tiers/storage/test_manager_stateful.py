"""Hypothesis state machine: a StorageOffloadingManager on real slab files,
driven through its real worker, against a plain model.

The model holds each key's state ("pending" or "ready") and its pins.
Stores are written for real before complete_store (or reported failed),
loads read back for real and must return the key's own bytes; after every
step the manager's slots, policy and pins match the model, and the durable
index names every ready key at its slot.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import Counter

import hypothesis.strategies as st
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvoffload.abstractions import CPULoadStoreSpec, LookupResult, ReqContext
from kvoffload.tiers.host_pool import HostPool
from kvoffload.tiers.storage.tier import StorageTier
from storage_helpers import CHUNK, NS, close, expected, fill, key

CAPACITY = 5
SHM = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
KEYS = [key(i) for i in range(12)]
key_lists = st.lists(st.sampled_from(KEYS), min_size=1, max_size=4)
picks = st.integers(0, 1000)


class StorageManagerMachine(RuleBasedStateMachine):
    policy = "lru"

    def __init__(self):
        super().__init__()
        # real files; on tmpfs where there is one, so its thousands of fsyncs stay cheap
        self.dir = tempfile.mkdtemp(prefix="kvoffload-stateful-", dir=SHM)
        self.tier = StorageTier(self.dir, CAPACITY * CHUNK, CHUNK, NS, eviction_policy=self.policy,
                                num_files=2, io_threads=2, direct_io=SHM is None, enable_events=True)
        self.pool = HostPool(8, CHUNK)
        self.m = self.tier.get_manager()
        self.worker = self.tier.get_worker(self.pool)
        self.state: dict[bytes, str] = {}  # key -> "pending" | "ready"
        self.pins: Counter[bytes] = Counter()
        self.stores: list[tuple[list[bytes], object]] = []  # (keys_to_store, store spec) in flight
        self.loads: list[tuple[list[bytes], object]] = []  # (keys, load spec) in flight
        self.job = 0
        self.ctx = ReqContext("r0")
        self.m.on_new_request(self.ctx)

    def teardown(self):
        close(self.tier)
        self.pool.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def snapshot(self):
        m = self.m
        return (dict(m._slot_of), dict(m._key_of), list(m._free), set(m._writing), dict(m._pins), len(m.policy))

    def evictable(self, exclude):
        return [k for k, s in self.state.items() if s == "ready" and not self.pins[k] and k not in exclude]

    def run_job(self, submit, *args) -> bool:
        self.job += 1
        assert submit(self.job, *args)
        self.worker.wait({self.job})
        (res,) = self.worker.get_finished()
        return res.success

    @rule(keys=key_lists)
    def prepare_store(self, keys):
        new = list(dict.fromkeys(k for k in keys if k not in self.state))
        need = len(new) - (CAPACITY - len(self.state))
        fits = need <= len(self.evictable(set(keys)))
        before = self.snapshot()
        out = self.m.prepare_store(keys, self.ctx)
        assert (out is not None) == fits, (keys, self.state, self.pins)
        if out is None:
            assert self.snapshot() == before
            return
        assert out.keys_to_store == new
        assert len(out.evicted_keys) == max(need, 0)
        for k in out.evicted_keys:
            assert self.state[k] == "ready" and not self.pins[k] and k not in keys
            del self.state[k]
        for k in new:
            self.state[k] = "pending"
        if new:
            self.stores.append((new, out.store_spec))

    @precondition(lambda self: self.stores)
    @rule(i=picks, success=st.booleans())
    def complete_store(self, i, success):
        keys, spec = self.stores.pop(i % len(self.stores))
        if success:  # the bytes really land first, as the tiering manager orders it
            for c, k in enumerate(keys):
                fill(self.pool, c, k)
            assert self.run_job(self.worker.submit_store, CPULoadStoreSpec(range(len(keys))), spec)
        self.m.complete_store(set(keys), self.ctx, success=success)
        for k in keys:
            if success:
                self.state[k] = "ready"
            else:
                del self.state[k]

    @rule(picked=st.lists(picks, min_size=1, max_size=3))
    def prepare_load(self, picked):
        ready = sorted(k for k, s in self.state.items() if s == "ready")
        if not ready:
            return
        keys = list(dict.fromkeys(ready[i % len(ready)] for i in picked))
        spec = self.m.prepare_load(keys, self.ctx)
        assert list(spec.block_ids) == [self.m._slot_of[k] for k in keys]
        self.pins.update(keys)
        self.loads.append((keys, spec))

    @precondition(lambda self: self.loads)
    @rule(i=picks)
    def complete_load(self, i):
        keys, spec = self.loads.pop(i % len(self.loads))
        chunks = list(range(4, 4 + len(keys)))
        assert self.run_job(self.worker.submit_load, spec, CPULoadStoreSpec(chunks))
        for c, k in zip(chunks, keys):
            np.testing.assert_array_equal(self.pool.chunk(c), expected(k))
        self.m.complete_load(keys, self.ctx)
        self.pins.subtract(keys)

    @rule(key=st.sampled_from(KEYS))
    def unreadable_load_changes_nothing(self, key):
        if self.state.get(key) == "ready":
            return
        before = self.snapshot()
        try:
            self.m.prepare_load([key], self.ctx)
        except KeyError:
            pass
        else:
            raise AssertionError("a key that is not readable was handed out")
        assert self.snapshot() == before

    @rule(keys=key_lists)
    def touch(self, keys):
        self.m.touch(keys, self.ctx)

    @rule()
    def new_request(self):
        self.m.on_request_finished(self.ctx)
        self.ctx = ReqContext(f"r{self.job}")
        self.m.on_new_request(self.ctx)

    @rule()
    def reset_cache(self):
        self.m.reset_cache()
        for k in self.evictable(()):
            del self.state[k]

    @rule(key=st.sampled_from(KEYS))
    def lookup(self, key):
        want = {None: LookupResult.MISS, "pending": LookupResult.HIT_PENDING, "ready": LookupResult.HIT}
        assert self.m.lookup(key, self.ctx) is want[self.state.get(key)]

    @invariant()
    def slots_match_model(self):
        m = self.m
        assert set(m._slot_of) == set(self.state)
        assert {s: k for k, s in m._slot_of.items()} == m._key_of
        slots = list(m._slot_of.values())
        assert sorted(slots + m._free) == list(range(CAPACITY))
        assert m._writing == {k for k, s in self.state.items() if s == "pending"}
        ready = {k for k, s in self.state.items() if s == "ready"}
        assert {k for k in KEYS if k in m.policy} == ready and len(m.policy) == len(ready)
        assert {k: n for k, n in m._pins.items() if n} == {k: n for k, n in self.pins.items() if n}
        g = m.get_stats().gauges
        assert g["used_blocks"] == len(self.state)
        assert g["pinned_blocks"] == sum(1 for k in self.state if self.pins[k])

    @invariant()
    def index_names_every_ready_key(self):
        durable = self.tier.store.durable
        for k, s in self.state.items():
            if s == "ready":
                assert durable[self.m._slot_of[k]][0] == k
        # what a restart would serve: every entry is a ready key at its slot, or a stale one
        # whose slot no readable key holds
        for slot, (k, _) in durable.items():
            if self.state.get(k) == "ready" and self.m._slot_of[k] != slot:
                owner = self.m._key_of.get(slot)
                assert owner is None or self.state[owner] == "pending"


class ARCStorageMachine(StorageManagerMachine):
    policy = "arc"


SETTINGS = settings(max_examples=40, stateful_step_count=30, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
TestLRUStorageManager = StorageManagerMachine.TestCase
TestLRUStorageManager.settings = SETTINGS
TestARCStorageManager = ARCStorageMachine.TestCase
TestARCStorageManager.settings = SETTINGS
