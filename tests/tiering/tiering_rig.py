"""A real CPU manager + host pool + storage tier on files, wired like the
tiered spec does, for the tiering tests."""

from __future__ import annotations

import numpy as np

from kvoffload.abstractions import LookupResult, ReqContext, ScheduleEndContext
from kvoffload.keys import make_offload_key
from kvoffload.tiering import Tier, TieringManager
from kvoffload.tiers.base import Namespace
from kvoffload.tiers.host_pool import HostPool
from kvoffload.tiers.cpu.manager import CPUOffloadingManager
from kvoffload.tiers.storage.tier import StorageTier

CHUNK = 16 * 1024
NS = Namespace(model="m", dtype="f16", layout="t", block_size=16, chunk_bytes=CHUNK)
END = ScheduleEndContext((), ())
HIT, MISS, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING


def key(i: int) -> bytes:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def pattern(k: bytes) -> np.ndarray:
    seed = int.from_bytes(k[:8], "big")
    return (np.arange(seed, seed + CHUNK // 8, dtype=np.uint64) * 11400714819323198485).view(np.uint8)


class Rig:
    """CPU manager + host pool + storage tier, wired like the spec does."""

    def __init__(self, tmp_path, cpu_chunks=4, storage_slots=64, events=False, tier_cls=StorageTier, policy="lru",
                 worker_wrap=None, **tier_kw):
        self.pool = HostPool(cpu_chunks, CHUNK)
        self.cpu = CPUOffloadingManager(cpu_chunks, policy, enable_events=events)
        self.storage = tier_cls(str(tmp_path / "kv"), storage_slots * CHUNK, CHUNK, NS, enable_events=events)
        self.tier = Tier(self.storage, **tier_kw)
        self.mgr = TieringManager(self.cpu, [self.tier])
        worker = self.storage.get_worker(self.pool)
        self.mgr.attach_workers([worker if worker_wrap is None else worker_wrap(worker)])

    def request(self, req_id="r", **params) -> ReqContext:
        ctx = ReqContext(req_id, kv_transfer_params=params or None)
        self.mgr.on_new_request(ctx)
        return ctx

    def gpu_store(self, keys, ctx) -> None:
        """What the engine does for GPU -> CPU: prepare, copy, complete."""
        out = self.mgr.prepare_store(keys, ctx)
        assert out is not None
        for k, slot in zip(out.keys_to_store, out.store_spec.block_ids):
            self.pool.chunk(int(slot))[:] = pattern(k)
        self.mgr.complete_store(out.keys_to_store, ctx)

    def settle(self) -> None:
        self.mgr.on_schedule_end(END)
        self.mgr.wait_idle()

    def in_storage_only(self, ctx, keys, filler) -> None:
        """Store keys, then push them out of CPU with filler (storage keeps both)."""
        for k in keys + filler:
            self.gpu_store([k], ctx)
            self.settle()
        assert all(self.cpu.slot_of(k) is None for k in keys)

    def close(self):
        self.mgr.shutdown()
        self.pool.close()


class LateReports:
    """A tier worker reporting each finished job one get_finished() call late
    while `late` is set: a race a real worker shows rarely (its copy thread
    finishes a job inside wait() and queues the report after the next poll),
    so a reset may see a waited job reported only after it."""

    def __init__(self, inner, late: bool = True):
        self.inner = inner
        self.late = late
        self._held = []

    def submit_store(self, job_id, src, dst):
        return self.inner.submit_store(job_id, src, dst)

    def submit_load(self, job_id, src, dst):
        return self.inner.submit_load(job_id, src, dst)

    def get_finished(self):
        now = list(self.inner.get_finished())
        if self.late:
            out, self._held = self._held, now
            return out
        out, self._held = self._held + now, []
        return out

    def wait(self, job_ids):
        self.inner.wait(job_ids)

    def shutdown(self):
        self.inner.shutdown()


class QueueFull:
    """A tier worker whose queue is full while `full` is set: it refuses
    every store (a Redis or Mooncake worker past max_queue_bytes, behind a
    slow server)."""

    def __init__(self, inner, full: bool = True):
        self.inner = inner
        self.full = full
        self.refused = 0

    def submit_store(self, job_id, src, dst):
        if self.full:
            self.refused += 1
            return False
        return self.inner.submit_store(job_id, src, dst)

    def submit_load(self, job_id, src, dst):
        return self.inner.submit_load(job_id, src, dst)

    def get_finished(self):
        return self.inner.get_finished()

    def wait(self, job_ids):
        self.inner.wait(job_ids)

    def shutdown(self):
        self.inner.shutdown()
