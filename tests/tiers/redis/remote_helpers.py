"""Small drivers for remote-tier tests: a tier on a host pool, and the
store / lookup / load steps an engine would take (with RETRY answered by
stepping again, as a scheduler does)."""

from __future__ import annotations

import time

import numpy as np

from kvoffload.abstractions import CPULoadStoreSpec, LookupResult, ReqContext, ScheduleEndContext
from kvoffload.tiers.base import Namespace
from kvoffload.tiers.host_pool import HostPool
from kvoffload.tiers.redis import RemoteTier

CTX = ReqContext("test")
STEP = ScheduleEndContext((), ())


# Timeouts for a healthy server on a loaded machine: the defaults (a 0.5 s
# lookup deadline, 2 s sockets) can expire there and turn a HIT into a MISS.
# Tests of the timeouts themselves give their own.
PATIENT = dict(connect_timeout_s=30.0, socket_timeout_s=30.0, lookup_deadline_s=30.0)


def make_tier(url: str, prefix: str, num_chunks: int = 32, chunk_bytes: int = 64 << 10, **cfg):
    pool = HostPool(num_chunks, chunk_bytes)
    ns = Namespace(model="tiny", dtype="bf16", layout="canon", block_size=16, chunk_bytes=pool.used_chunk_bytes)
    tier = RemoteTier({"url": url, "key_prefix": prefix, **PATIENT, **cfg}, ns)
    return tier, tier.get_manager(), tier.get_worker(pool), pool


def keys_for(n: int, seed: int = 0) -> list[bytes]:
    return [(seed * 1_000_003 + i).to_bytes(16, "big") + b"\0\0\0\0" for i in range(n)]


def fill(pool: HostPool, slots, seed: int) -> None:
    """Deterministic bytes per (seed, slot index in the call) so another process can check them."""
    for j, s in enumerate(slots):
        rng = np.random.default_rng([seed, j])
        pool.chunk(s)[: pool.used_chunk_bytes] = rng.integers(0, 256, pool.used_chunk_bytes, dtype=np.uint8)


def expected(pool: HostPool, seed: int, j: int) -> np.ndarray:
    return np.random.default_rng([seed, j]).integers(0, 256, pool.used_chunk_bytes, dtype=np.uint8)


_job = iter(range(1, 1 << 62))


def store(manager, worker, keys, slots) -> bool:
    """prepare_store -> submit -> wait -> complete_store; True if written (or nothing to write)."""
    out = manager.prepare_store(keys, CTX)
    if out is None:
        return False
    pos = {k: s for k, s in zip(keys, slots)}
    job = next(_job)
    accepted = worker.submit_store(job, CPULoadStoreSpec([pos[k] for k in out.keys_to_store]), out.store_spec)
    ok = False
    if accepted:
        worker.wait({job})
        ok = all(r.success for r in worker.get_finished() if r.job_id == job)
    manager.complete_store(keys, CTX, success=ok)
    return ok


def lookup(manager, key, give_up_s: float = 45.0) -> LookupResult:
    """Ask until the answer is not RETRY, stepping the 'scheduler' in between
    (bounded in time, not steps: a loaded machine takes fewer, slower steps)."""
    deadline = time.monotonic() + give_up_s
    while time.monotonic() < deadline:
        r = manager.lookup(key, CTX)
        if r is not LookupResult.RETRY:
            return r
        manager.on_schedule_end(STEP)
        time.sleep(0.001)
    raise AssertionError(f"lookup still RETRY after {give_up_s} s")


def wait_until(condition, what: str, give_up_s: float = 120.0) -> None:
    """Poll a condition (generously bounded) instead of sleeping a guess."""
    deadline = time.monotonic() + give_up_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not after {give_up_s} s"
        time.sleep(0.02)


def load(manager, worker, keys, slots) -> bool:
    spec = manager.prepare_load(keys, CTX)
    job = next(_job)
    assert worker.submit_load(job, spec, CPULoadStoreSpec(slots))
    worker.wait({job})
    ok = all(r.success for r in worker.get_finished() if r.job_id == job)
    manager.complete_load(keys, CTX)
    return ok


def total(stats_list, name: str) -> float:
    return sum(s.counters.get(name, 0) for s in stats_list)


def undeclared(stats) -> list[str]:
    """Stat names with no declared series: vLLM's metrics leave those out."""
    from kvoffload.metrics import COUNTERS, GAUGES

    return [n for n in stats.counters if n not in COUNTERS] + [n for n in stats.gauges if n not in GAUGES]
