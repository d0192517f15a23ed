"""Where a replay's time goes: timed proxies around the offload manager and
worker, so the simulation calls them plainly and the accounting lives here.

Every call through a proxy adds its duration to the proxy's total; manager
calls also keep one sample per call, its seconds per block (the call's time
divided by its blocks) and its blocks, for the per-block percentiles of the
report (weighted by blocks: a lookup of 1,000 blocks counts 1,000 times). The
proxies look the wrapped object's method up at each call (not once at
start), so a method replaced on the wrapped object later is still the one
called and timed.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvoffload.abstractions import LookupResult

_perf = time.perf_counter
_MISS = LookupResult.MISS


class TimedManager:
    """An OffloadingManager whose calls are timed (`seconds`, `per_block`)."""

    def __init__(self, manager: Any):
        self.inner = manager
        self.seconds = 0.0
        self.per_block = array("d")  # per call: seconds / blocks
        self.blocks = array("q")  # per call: blocks
        self.by_call: dict[str, float] = {}  # seconds per method name

    def _timed(self, name: str, n: int, *args, **kwargs):
        t0 = _perf()
        try:
            return getattr(self.inner, name)(*args, **kwargs)
        finally:
            dt = _perf() - t0
            self.seconds += dt
            self.by_call[name] = self.by_call.get(name, 0.0) + dt
            self.per_block.append(dt / (n or 1))
            self.blocks.append(n or 1)

    def lookup_prefix(self, keys: Sequence[bytes], ctx) -> tuple[int, bytes | None]:
        """The manager's lookup_prefix() (lookup() of keys in prefix order up
        to the first non-HIT), timed as one call of len(keys) blocks: (leading
        hits, the key that answered HIT_PENDING or RETRY, or None if the run
        ended on a MISS or the end)."""
        t0 = _perf()
        n, r = self.inner.lookup_prefix(keys, ctx)
        dt = _perf() - t0
        self.seconds += dt
        self.by_call["lookup"] = self.by_call.get("lookup", 0.0) + dt
        if keys:
            looked = min(n + 1, len(keys))  # the hits and the lookup that ended the run
            self.per_block.append(dt / looked)
            self.blocks.append(looked)
        return n, (keys[n] if r is not None and r is not _MISS else None)

    def ns_per_block(self) -> dict[str, float]:
        """p50, p99 and mean of the manager's nanoseconds per block, over blocks."""
        if not self.per_block:
            return {"p50": 0.0, "p99": 0.0, "mean": 0.0}
        t = np.frombuffer(self.per_block, dtype=np.float64) * 1e9
        w = np.frombuffer(self.blocks, dtype=np.int64)
        order = np.argsort(t, kind="stable")
        cum = np.cumsum(w[order])

        def pct(q: float) -> float:
            return float(t[order][np.searchsorted(cum, q / 100.0 * cum[-1])])

        return {"p50": pct(50), "p99": pct(99), "mean": float((t * w).sum() / w.sum())}

    def lookup(self, key, ctx):
        return self._timed("lookup", 1, key, ctx)

    def prepare_load(self, keys, ctx):
        return self._timed("prepare_load", len(keys), keys, ctx)

    def complete_load(self, keys, ctx):
        return self._timed("complete_load", len(keys), keys, ctx)

    def prepare_store(self, keys, ctx):
        return self._timed("prepare_store", len(keys), keys, ctx)

    def complete_store(self, keys, ctx, success: bool = True):
        return self._timed("complete_store", len(keys), keys, ctx, success=success)

    def touch(self, keys, ctx):
        return self._timed("touch", len(keys), keys, ctx)

    def on_new_request(self, ctx):
        return self._timed("on_new_request", 1, ctx)

    def on_request_finished(self, ctx):
        return self._timed("on_request_finished", 1, ctx)

    def reset_cache(self):
        return self._timed("reset_cache", 1)

    def on_reset_flushed(self):
        return self._timed("on_reset_flushed", 1)

    def on_schedule_end(self, ctx):
        """Not a per-block call: its time counts, no per-block sample."""
        t0 = _perf()
        try:
            return self.inner.on_schedule_end(ctx)
        finally:
            self.seconds += _perf() - t0

    def get_stats(self):
        t0 = _perf()
        try:
            return self.inner.get_stats()
        finally:
            self.seconds += _perf() - t0


class TimedWorker:
    """An OffloadingWorker whose submit/wait/get_finished calls are timed
    (`seconds`): what the engine spends handing jobs to the copier and
    waiting for them."""

    def __init__(self, worker: Any):
        self.inner = worker
        self.seconds = 0.0

    def _timed(self, name: str, *args):
        t0 = _perf()
        try:
            return getattr(self.inner, name)(*args)
        finally:
            self.seconds += _perf() - t0

    def submit_load(self, job_id, src, dst):
        return self._timed("submit_load", job_id, src, dst)

    def submit_store(self, job_id, src, dst):
        return self._timed("submit_store", job_id, src, dst)

    def wait(self, job_ids):
        return self._timed("wait", job_ids)

    def get_finished(self):
        return self._timed("get_finished")


class Stopwatch:
    """Seconds spent in `with` blocks of one kind (block contents, idle)."""

    __slots__ = ("seconds", "_t0")

    def __init__(self):
        self.seconds = 0.0
        self._t0 = 0.0

    def __enter__(self):
        self._t0 = _perf()
        return self

    def __exit__(self, *exc):
        self.seconds += _perf() - self._t0
