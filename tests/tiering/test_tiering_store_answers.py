"""The tiered manager's answers to offers: None, or every new key stored
but those it counts (store_blocks_declined by the CPU tier's policy,
store_blocks_cut by the head cut). A state machine over a real CPU manager,
host pool and storage tier on files, whose worker reports late (cascades
pin CPU copies meanwhile, so offers meet a CPU tier held by them)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import hypothesis.strategies as st
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvoffload.abstractions import ReqContext
from kvoffload.tiering import Tier, TieringManager
from kvoffload.tiers.cpu.manager import CPUOffloadingManager
from kvoffload.tiers.cpu.slot_state import PENDING
from kvoffload.tiers.host_pool import HostPool
from kvoffload.tiers.storage.tier import StorageTier
from tiering_rig import CHUNK, END, NS, LateReports, key

CPU_CHUNKS = 8
PREFIX_LEN = 10
picks = st.integers(0, 1000)
COUNTED = ("store_blocks_declined", "store_blocks_cut")


def K(prefix: int, i: int) -> bytes:
    return key(prefix * 100 + i)


class TieredStoreAnswers(RuleBasedStateMachine):
    policy = "lru"

    def __init__(self):
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="kvo-store-answers-"))
        self.pool = HostPool(CPU_CHUNKS, CHUNK)
        self.cpu = CPUOffloadingManager(CPU_CHUNKS, self.policy)
        self.storage = StorageTier(str(self.dir / "kv"), 64 * CHUNK, CHUNK, NS)
        self.tier = Tier(self.storage, max_queue_depth=64)
        self.mgr = TieringManager(self.cpu, [self.tier])
        self.mgr.attach_workers([LateReports(self.storage.get_worker(self.pool))])
        self.running: dict[str, tuple[ReqContext, int, int]] = {}
        self.stores: list[tuple[ReqContext, list[bytes]]] = []
        self.loads: list[tuple[ReqContext, list[bytes]]] = []
        self.n = 0
        self.mgr.get_stats()

    @precondition(lambda self: len(self.running) < 3)
    @rule(prefix=st.integers(0, 3))
    def new_request(self, prefix):
        ctx = ReqContext(f"r{self.n}")
        self.n += 1
        for i in range(PREFIX_LEN):
            ctx.set_offload_key_position(K(prefix, i), (i + 1) * 16)
        self.mgr.on_new_request(ctx)
        self.running[ctx.req_id] = (ctx, prefix, 0)

    def _counted(self) -> float:
        return sum(s.counters.get(n, 0) for s in self.mgr.get_stats().walk() for n in COUNTED)

    @precondition(lambda self: self.running)
    @rule(i=picks, n=st.integers(1, 9), again=st.integers(0, 3))
    def offer(self, i, n, again):
        rid = sorted(self.running)[i % len(self.running)]
        ctx, prefix, nxt = self.running[rid]
        if nxt >= PREFIX_LEN:
            return
        keys = [K(prefix, j) for j in range(max(0, nxt - again), min(PREFIX_LEN, nxt + n))]
        new = [k for k in keys if k not in self.cpu]
        self._counted()  # (zero the counters)
        out = self.mgr.prepare_store(keys, ctx)
        counted = self._counted()
        if out is None:
            assert counted == 0
            event("None")
            return
        stored = list(out.keys_to_store)
        assert set(stored) <= set(new)
        assert len(new) - len(stored) == counted, (new, stored, counted)
        event("stored whole" if len(stored) == len(new) else "part counted")
        self.running[rid] = (ctx, prefix, nxt + n)
        if stored:
            self.stores.append((ctx, stored))

    @precondition(lambda self: self.stores)
    @rule(i=picks)
    def complete_store(self, i):
        ctx, keys = self.stores.pop(i % len(self.stores))
        self.mgr.complete_store(keys, ctx)  # cascades: pinned until the tier's write lands

    @precondition(lambda self: self.running)
    @rule(i=picks, n=st.integers(1, CPU_CHUNKS))
    def load(self, i, n):
        """A request loads the readable part of its prefix's head (pinned)."""
        ctx, prefix, _ = self.running[sorted(self.running)[i % len(self.running)]]
        keys = []
        for j in range(n):
            slot = self.cpu.slot_of(K(prefix, j))
            if slot is None or self.cpu._state[slot] == PENDING:
                break
            keys.append(K(prefix, j))
        if keys:
            self.mgr.prepare_load(keys, ctx)
            self.loads.append((ctx, keys))

    @precondition(lambda self: self.loads)
    @rule(i=picks)
    def complete_load(self, i):
        ctx, keys = self.loads.pop(i % len(self.loads))
        self.mgr.complete_load(keys, ctx)

    @precondition(lambda self: self.running)
    @rule(i=picks)
    def finish(self, i):
        ctx, _, _ = self.running.pop(sorted(self.running)[i % len(self.running)])
        self.mgr.on_request_finished(ctx)

    @rule()
    def schedule_end(self):
        self.mgr.on_schedule_end(END)

    @invariant()
    def cascades_pin_at_most_a_quarter_of_cpu(self):
        assert self.tier.in_flight <= CPU_CHUNKS // 4

    def teardown(self):
        try:
            for ctx, keys in self.stores:
                self.mgr.complete_store(keys, ctx)
            for ctx, keys in self.loads:
                self.mgr.complete_load(keys, ctx)
            for ctx, _, _ in self.running.values():
                self.mgr.on_request_finished(ctx)
            for _ in range(3):
                self.mgr.on_schedule_end(END)
                self.mgr.wait_idle()
            assert not self.tier.waiting and self.tier.in_flight == 0
            assert self.cpu.get_stats().gauges["pinned_blocks"] == 0
        finally:
            self.mgr.shutdown()
            self.pool.close()
            shutil.rmtree(self.dir, ignore_errors=True)


def _case(policy: str):
    machine = type(f"TieredStoreAnswers_{policy}", (TieredStoreAnswers,), {"policy": policy})
    case = machine.TestCase
    case.settings = settings(max_examples=40, stateful_step_count=40, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow])
    return case


TestTieredStoreAnswers_lru = _case("lru")
TestTieredStoreAnswers_hubchain = _case("hubchain")
