"""The engine-time model's tiers: each tier below CPU moves a job's KV bytes
at a stated bandwidth on the replay's simulated clock, and its completions
reach the tiering manager when that clock says they land, never earlier or
later, whatever the machine's load.

A PacedWorker wraps a tier's real worker (the real job still runs: real
bytes, real files). Each tier is one FIFO channel: a job submitted at
simulated time t starts when the channel is free, takes latency + blocks x
modeled block bytes / bandwidth, and is due at its end. get_finished()
returns exactly the jobs due by the clock's time, in submission order; a due
job the real worker has not finished yet is waited for (counted: the
machine is slower than the modeled tier; the figures do not change). So
the same command gives the same completions at the same steps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvoffload.abstractions import Locality, Medium

# Modeled bandwidth (bytes/s) and per-job latency (s) of a tier by kind,
# each direction: a local NVMe drive as a storage tier (a datacenter drive
# writes 2-4 GB/s and reads 3-7; 2 GB/s is what one drive sustains under a
# mixed load), a remote store over 25 GbE (~3 GB/s; Redis's single thread
# less), a remote store over RDMA (Mooncake, ~10 GB/s). --tier-bandwidth
# NAME=RATE overrides one tier's.
DEFAULT_BANDWIDTH = {
    (Medium.STORAGE, Locality.LOCAL): 2e9,
    (Medium.CPU, Locality.REMOTE): 2.5e9,
}
FALLBACK_BANDWIDTH = 2e9
DEFAULT_LATENCY_S = 100e-6


@dataclass
class SimClock:
    now_s: float = 0.0  # simulated seconds since the replay's start


def default_bandwidth(tier) -> float:
    return DEFAULT_BANDWIDTH.get((tier.medium, tier.locality), FALLBACK_BANDWIDTH)


class PacedWorker:
    """A tier's TierWorker whose completions the simulated clock releases."""

    def __init__(self, inner, clock: SimClock, bandwidth: float, block_bytes: int,
                 latency_s: float = DEFAULT_LATENCY_S):
        self.inner = inner
        self.clock = clock
        self.bandwidth = bandwidth
        self.block_bytes = block_bytes
        self.latency_s = latency_s
        self.free_at = 0.0  # simulated time the channel finishes its last job
        self._due: dict[int, float] = {}  # job -> simulated time it lands (submission order)
        self._ready: dict[int, object] = {}  # job -> its result, finished in wall time
        self.late_waits = 0  # due jobs the real worker had not finished: waited for
        self.late_wait_s = 0.0
        self.busy_s = 0.0  # simulated seconds the channel was busy
        self.peak_backlog_s = 0.0  # the most work queued past the clock at a submission

    def _schedule(self, job_id: int, blocks: int) -> None:
        start = max(self.clock.now_s, self.free_at)
        took = self.latency_s + blocks * self.block_bytes / self.bandwidth
        self.free_at = start + took
        self.busy_s += took
        self._due[job_id] = self.free_at
        self.peak_backlog_s = max(self.peak_backlog_s, self.free_at - self.clock.now_s)

    def submit_store(self, job_id, src, dst) -> bool:
        ok = self.inner.submit_store(job_id, src, dst)
        if ok:
            self._schedule(job_id, len(src.block_ids))
        return ok

    def submit_load(self, job_id, src, dst) -> bool:
        ok = self.inner.submit_load(job_id, src, dst)
        if ok:
            self._schedule(job_id, len(dst.block_ids))
        return ok

    def next_due(self) -> float | None:
        """The simulated time the next job lands (None: none in flight)."""
        return min(self._due.values(), default=None)

    def backlog_s(self) -> float:
        """Simulated seconds of work queued past the clock's time."""
        return max(0.0, self.free_at - self.clock.now_s)

    def _collect(self) -> None:
        for res in self.inner.get_finished():
            self._ready[res.job_id] = res

    def get_finished(self) -> list:
        self._collect()
        now = self.clock.now_s
        due = [j for j, t in self._due.items() if t <= now]
        late = {j for j in due if j not in self._ready}
        if late:
            t0 = time.perf_counter()
            self.inner.wait(late)
            self.late_wait_s += time.perf_counter() - t0
            self.late_waits += 1
            self._collect()
        out = []
        for j in due:
            if j in self._ready:  # (a worker reports a job before wait() returns: always, here)
                del self._due[j]
                out.append(self._ready.pop(j))
        # results of jobs this wrapper never scheduled (none expected): as they come
        out.extend(self._ready.pop(j) for j in [j for j in self._ready if j not in self._due])
        return out

    def wait(self, job_ids) -> None:
        """The manager waits for these (a reset, the shutdown): they land now."""
        self.inner.wait(set(job_ids))
        for j in job_ids:
            if j in self._due:
                self._due[j] = -1.0

    def __getattr__(self, name):  # queue_depth, shutdown, ... of the real worker
        return getattr(self.inner, name)
