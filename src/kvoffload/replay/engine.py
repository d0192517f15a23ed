"""A simulated engine step loop that drives a real OffloadingSpec (manager and
worker) the way vLLM's scheduler and model runner do.

Per request: prompt blocks already on the GPU are hits; the rest are looked
up in the offload manager in prefix order up to the first miss (HIT_PENDING
or RETRY delay the request a step); hits are loaded with real byte copies
and checked byte for byte; newly computed blocks get contents derived from
their hash and are stored; then the request finishes and its GPU blocks
become idle prefix-cache entries (evicted LRU).

With no GPU cache and one request at a time (the defaults) this is exactly
the reference semantics of the trace README, so the offload tier's prefix
hit rate is comparable to its LRU/OPT table.
"""

from __future__ import annotations

import sys
import time
import zlib
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvoffload.abstractions import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LookupResult,
    OffloadPolicy,
    ReqContext,
    ScheduleEndContext,
)
from kvoffload.config import CacheConfig, ConfigError, KVGroupConfig, OffloadingConfig
from kvoffload.replay.gpu import GPUBlocks, seeds_of
from kvoffload.replay.traces import Request, Trace, mix64
from kvoffload.spec import build_spec

_HIT = LookupResult.HIT
_MISS = LookupResult.MISS
_GROUP0 = b"\0\0\0\0"


class VerificationError(RuntimeError):
    """A loaded block's bytes differ from what was stored."""


@dataclass
class EngineOptions:
    spec: str = "cpu"
    extra_config: dict[str, Any] = field(default_factory=dict)
    kv_bytes_per_token: int = 16
    gpu_blocks: int = 0  # GPU prefix cache: idle cached blocks kept
    max_running: int = 1  # requests in flight at once
    arrival: str = "asap"  # "asap" or "trace" (timestamps on a simulated clock)
    time_compression: float = 1.0
    prefill_tokens_per_s: float = 10_000.0
    max_delay_steps: int = 1000  # then a pending lookup counts as a miss
    idle_sleep_s: float = 0.0002  # a step with nothing to do sleeps this long
    # Let the tiers finish their own work (cascading stores) before the next
    # request starts: deterministic, slower; real engines do not wait.
    sync_tiers: bool = False
    samples: int = 100  # points of the hit-rate-over-time series
    strict: bool = False  # raise on the first byte mismatch instead of counting it
    progress: bool = True
    # Observability (off by default, inert when off): a PrometheusMetrics to
    # feed with the manager's stats and the worker's transfers, and a
    # ZmqEventPublisher for the manager's KV events.
    metrics: Any = None
    events: Any = None


@dataclass
class _Seen:
    """A request the scheduler has looked at (it may still be waiting)."""

    ctx: ReqContext
    keys: list[bytes]  # prompt keys, prefix order
    request_level: bool  # the manager wants every block stored, hits too
    pending: set[bytes] = field(default_factory=set)  # keys that answered HIT_PENDING/RETRY


@dataclass
class _Run:
    req: Request
    ctx: ReqContext
    keys: list[bytes]  # prompt keys, then decode keys
    hashes: list[int]
    slots: list[int]
    n_gpu: int
    n_off: int
    phase: str = "load"  # load -> store -> done
    jobs: set[int] = field(default_factory=set)
    request_level: bool = False
    bad: list[int] = field(default_factory=list)  # loaded block indices that failed
    stored: set[bytes] = field(default_factory=set)  # keys this request stored


@dataclass
class ReplayResult:
    trace: str
    options: dict[str, Any]
    counters: dict[str, float]
    tiers: dict[str, dict[str, Any]]  # per offload tier: counters + gauges from get_stats
    manager_ns_per_block: dict[str, float]
    timeline: list[dict[str, float]]
    wall_s: float
    manager_s: float
    worker_s: float
    content_s: float
    idle_s: float
    cpu_s: float  # CPU time of the process (all threads) during the run
    oracle: dict[str, float] = field(default_factory=dict)

    @property
    def harness_s(self) -> float:
        return max(0.0, self.wall_s - self.manager_s - self.worker_s - self.idle_s)


class ReplayEngine:
    def __init__(self, trace: Trace, opts: EngineOptions):
        self.trace = trace
        self.opts = opts
        bs = trace.block_size
        page = opts.kv_bytes_per_token * bs
        if opts.kv_bytes_per_token <= 0 or page % 8:
            raise ConfigError(f"kv_bytes_per_token * block_size must be a positive multiple of 8, "
                              f"got {opts.kv_bytes_per_token} * {bs}")
        if opts.max_running <= 0:
            raise ConfigError(f"max_running must be positive, got {opts.max_running}")
        for name in ("time_compression", "prefill_tokens_per_s"):
            if not getattr(opts, name) > 0:
                raise ConfigError(f"{name} must be positive, got {getattr(opts, name)!r}")
        if opts.gpu_blocks < 0:
            raise ConfigError(f"gpu_blocks must be 0 or more, got {opts.gpu_blocks}")
        if opts.arrival not in ("asap", "trace"):
            raise ConfigError(f"arrival must be 'asap' or 'trace', got {opts.arrival!r}")
        self.page_bytes = page
        config = OffloadingConfig(
            groups=(KVGroupConfig(tokens_per_block=bs),),
            cache=CacheConfig(tokens_per_hash=bs, blocks_per_chunk=1),
            extra_config=dict(opts.extra_config),
            enable_kv_cache_events=opts.events is not None,
        )
        self.spec = build_spec(opts.spec, config)
        self.prompt_only = self.spec.offload_prompt_only
        # Room for every running request at its largest, plus the cache.
        biggest = max(len(r.block_hashes) + self._num_decode_blocks(r) for r in trace.requests)
        num_gpu = opts.gpu_blocks + opts.max_running * max(1, biggest)
        self.gpu = GPUBlocks(num_gpu, page, opts.gpu_blocks)
        kv = CanonicalKVCaches(
            tensors=[CanonicalKVCacheTensor(self.gpu.tensor, page)],
            group_data_refs=[[CanonicalKVCacheRef(tensor_idx=0, page_size_bytes=page)]],
        )
        # Worker first: a spec sized in bytes learns its chunk size from the KV caches.
        self.worker = self.spec.get_worker(kv)
        self.manager = self.spec.get_manager()
        self._job_id = 0
        self._jobs: dict[int, tuple[_Run, bool, list[bytes], np.ndarray, np.ndarray, int]] = {}
        self.c: dict[str, float] = dict.fromkeys((
            "requests", "prompt_tokens", "block_refs", "gpu_hit_blocks", "offload_hit_blocks",
            "offload_hit_blocks_after_pending", "idle_waits",
            "gpu_hit_tokens", "offload_hit_tokens", "recomputed_tokens", "stored_blocks_offered",
            "store_jobs", "load_jobs", "bytes_loaded", "bytes_stored", "load_time_s", "store_time_s",
            "evicted_blocks", "allocation_failures", "delayed_lookups", "delay_timeouts",
            "load_failures", "store_failures", "verify_failures", "verified_blocks",
            "gpu_evictions", "steps", "sim_time_ms",
        ), 0)
        self._mgr_t: list[float] = []  # per call: seconds per block
        self._mgr_s = 0.0
        self._worker_s = 0.0
        self._content_s = 0.0
        self._idle_s = 0.0
        self._tiers: dict[str, dict[str, Any]] = {}
        self.timeline: list[dict[str, float]] = []

    # ---- helpers ------------------------------------------------------------

    def _num_decode_blocks(self, r: Request) -> int:
        if r.decode_hashes is not None:
            return len(r.decode_hashes)
        bs = self.trace.block_size
        return max(0, (r.prompt_tokens + r.output_tokens) // bs - len(r.block_hashes))

    def _mgr(self, t0: float, n: int) -> None:
        dt = time.perf_counter() - t0
        self._mgr_s += dt
        self._mgr_t.append(dt / max(1, n))

    def _next_job(self) -> int:
        self._job_id += 1
        return self._job_id

    def _collect_stats(self) -> None:
        t0 = time.perf_counter()
        st = self.manager.get_stats()
        self._mgr_s += time.perf_counter() - t0
        if st is None:
            return
        if self.opts.metrics is not None:
            self.opts.metrics.record_stats(st)
        for s in st.walk():
            tier = self._tiers.setdefault(s.tier, {"medium": getattr(s.medium, "value", None),
                                                   "locality": getattr(s.locality, "value", None),
                                                   "composite": bool(s.children),
                                                   "counters": {}, "gauges": {}})
            for k, v in s.counters.items():
                tier["counters"][k] = tier["counters"].get(k, 0) + v
            tier["gauges"].update(s.gauges)

    # ---- the step loop ------------------------------------------------------

    def run(self) -> ReplayResult:
        opts = self.opts
        reqs = self.trace.requests
        total = len(reqs)
        arrivals = deque(reqs)
        waiting: deque[tuple[Request, int]] = deque()  # (request, steps delayed)
        self.running: list[_Run] = []
        self._seen: dict[str, _Seen] = {}  # requests looked at, not finished
        done = 0
        sample_at = max(1, total // max(1, opts.samples))
        bar = _progress(total, opts.progress, self.trace.name)
        now = 0.0
        t_start = time.perf_counter()
        cpu_start = time.process_time()
        while done < total:
            c = self.c
            c["steps"] += 1
            # admit arrivals
            if opts.arrival == "asap":
                while arrivals and len(waiting) < opts.max_running + 64:
                    waiting.append((arrivals.popleft(), 0))
            else:
                if not waiting and not self.running and arrivals:
                    now = max(now, arrivals[0].arrival_ms / opts.time_compression)
                while arrivals and arrivals[0].arrival_ms / opts.time_compression <= now:
                    waiting.append((arrivals.popleft(), 0))
            if opts.sync_tiers and not self.running:
                self._drain_tiers()
            new_ids = self._schedule(waiting)
            t0 = time.perf_counter()
            self.manager.on_schedule_end(ScheduleEndContext(new_ids, ()))
            self._mgr_s += time.perf_counter() - t0
            if opts.events is not None:
                opts.events.publish(self.manager.take_events())
            finished = self._settle()
            if not finished and not new_ids:
                t0 = time.perf_counter()
                if self._jobs:
                    self.worker.wait(set(self._jobs))
                    self._worker_s += time.perf_counter() - t0
                else:  # only the tiers are busy (promotions): let their threads run
                    time.sleep(self.opts.idle_sleep_s)
                    self._idle_s += time.perf_counter() - t0
                    c["idle_waits"] += 1
                finished = self._settle()
            now += max(1.0, 1000.0 * self._step_tokens / opts.prefill_tokens_per_s)
            for _ in range(finished):
                done += 1
                if done % sample_at == 0 or done == total:
                    self._sample(done)
            if bar is not None and finished:
                bar.update(finished)
        self._drain_tiers()
        if opts.events is not None:
            opts.events.publish(self.manager.take_events())
        wall = time.perf_counter() - t_start
        cpu = time.process_time() - cpu_start
        if bar is not None:
            bar.close()
        self.c["sim_time_ms"] = now
        self.c["gpu_evictions"] = self.gpu.evictions
        self._collect_stats()
        t = np.array(self._mgr_t) * 1e9 if self._mgr_t else np.zeros(1)
        return ReplayResult(
            trace=self.trace.name,
            options={k: v for k, v in vars(opts).items() if k != "progress"} | {
                "block_size": self.trace.block_size, "page_bytes": self.page_bytes,
                "offload_prompt_only": self.prompt_only},
            counters=dict(self.c),
            tiers=self._tiers,
            manager_ns_per_block={"p50": float(np.percentile(t, 50)), "p99": float(np.percentile(t, 99)),
                                  "mean": float(t.mean())},
            timeline=self.timeline,
            wall_s=wall, manager_s=self._mgr_s, worker_s=self._worker_s, content_s=self._content_s,
            idle_s=self._idle_s, cpu_s=cpu,
        )

    def _drain_tiers(self, timeout_s: float = 60.0) -> None:
        """Keep stepping while the manager has work of its own (cascading
        stores to lower tiers), as an engine does, so the stats are final."""
        deadline = time.perf_counter() + timeout_s
        while self.manager.has_pending_work() and time.perf_counter() < deadline:
            t0 = time.perf_counter()
            self.manager.on_schedule_end(ScheduleEndContext((), ()))
            self._mgr_s += time.perf_counter() - t0
            time.sleep(self.opts.idle_sleep_s)
            self._idle_s += time.perf_counter() - t0

    def close(self) -> None:
        self.worker.shutdown()
        self.manager.shutdown()

    # ---- scheduling ---------------------------------------------------------

    def _schedule(self, waiting: deque) -> list[str]:
        """Start waiting requests while there is room; returns their ids."""
        new_ids: list[str] = []
        self._step_tokens = 0  # tokens prefilled this step (the simulated clock)
        mgr = self.manager
        c = self.c
        skipped: list[tuple[Request, int]] = []  # delayed: first in line next step, as in vLLM
        for _ in range(len(waiting)):
            if len(self.running) >= self.opts.max_running:
                break
            req, delays = waiting.popleft()
            seen = self._seen.get(req.req_id)
            hashes = req.block_hashes
            if seen is None:  # first sight of the request
                ctx = ReqContext(req.req_id, req.kv_transfer_params)
                bs = self.trace.block_size
                keys = [h.to_bytes(8, "big") + _GROUP0 for h in hashes]
                for i, k in enumerate(keys):
                    ctx.set_offload_key_position(k, (i + 1) * bs)
                t0 = time.perf_counter()
                roc = mgr.on_new_request(ctx)
                self._mgr(t0, 1)
                seen = self._seen[req.req_id] = _Seen(ctx, keys, roc.policy == OffloadPolicy.REQUEST_LEVEL)
            ctx, keys = seen.ctx, seen.keys
            n_gpu = self.gpu.match(hashes)
            n_off = 0
            pending = False
            lookup = mgr.lookup
            perf = time.perf_counter
            for k in keys[n_gpu:]:
                t0 = perf()
                r = lookup(k, ctx)
                dt = perf() - t0
                self._mgr_s += dt
                self._mgr_t.append(dt)
                if r is _HIT:
                    n_off += 1
                    continue
                if r is not _MISS:
                    pending = True
                    seen.pending.add(k)
                break
            if pending:
                if delays < self.opts.max_delay_steps:
                    c["delayed_lookups"] += 1
                    skipped.append((req, delays + 1))
                    continue
                c["delay_timeouts"] += 1
            n_dec = self._num_decode_blocks(req)
            fresh = self.gpu.allocate(len(hashes) - n_gpu + n_dec)
            if fresh is None:  # running requests hold the GPU: try next step
                waiting.appendleft((req, delays))
                break
            slots = self.gpu.acquire(hashes[:n_gpu]) + fresh
            if n_dec:
                dec = req.decode_hashes if req.decode_hashes is not None else _unique_hashes(req, n_dec)
                keys = keys + [h.to_bytes(8, "big") + _GROUP0 for h in dec]
                hashes = hashes + list(dec)
            run = _Run(req, ctx, keys, hashes, slots, n_gpu, n_off, request_level=seen.request_level)
            self.running.append(run)
            new_ids.append(req.req_id)
            # vLLM touches every block of the request, GPU-cached ones too; before
            # the store below, so this request's own blocks are not its victims.
            plen = len(req.block_hashes)
            t0 = time.perf_counter()
            mgr.touch(keys[:plen], ctx)
            self._mgr(t0, plen)
            c["requests"] += 1
            c["prompt_tokens"] += req.prompt_tokens
            c["block_refs"] += plen
            c["gpu_hit_blocks"] += n_gpu
            c["offload_hit_blocks"] += n_off
            if seen.pending:
                # answered HIT_PENDING first: promoted from a lower tier (or a
                # store in flight) before this request could load it
                was = seen.pending
                c["offload_hit_blocks_after_pending"] += sum(k in was for k in keys[n_gpu:n_gpu + n_off])
            tok = self.trace.block_tokens
            g_tok = sum(tok(req, i) for i in range(n_gpu))
            o_tok = sum(tok(req, i) for i in range(n_gpu, n_gpu + n_off))
            c["gpu_hit_tokens"] += g_tok
            c["offload_hit_tokens"] += o_tok
            c["recomputed_tokens"] += req.prompt_tokens - g_tok - o_tok
            self._step_tokens += req.prompt_tokens - g_tok - o_tok
            if n_off:
                self._submit_load(run)
        waiting.extendleft(reversed(skipped))
        return new_ids

    def _submit_load(self, run: _Run) -> None:
        lo, hi = run.n_gpu, run.n_gpu + run.n_off
        keys = run.keys[lo:hi]
        slots = np.array(run.slots[lo:hi], dtype=np.int64)
        t0 = time.perf_counter()
        src = self.manager.prepare_load(keys, run.ctx)
        self._mgr(t0, len(keys))
        job = self._next_job()
        self._jobs[job] = (run, True, keys, slots, seeds_of(run.hashes[lo:hi]), lo)
        t0 = time.perf_counter()
        ok = self.worker.submit_load(job, src, GPULoadStoreSpec(slots))
        self._worker_s += time.perf_counter() - t0
        self.c["load_jobs"] += 1
        if ok:
            run.jobs.add(job)
            return
        # refused: unpin and recompute those blocks
        del self._jobs[job]
        self.c["load_failures"] += len(keys)
        run.bad.extend(range(lo, hi))
        t0 = time.perf_counter()
        self.manager.complete_load(keys, run.ctx)
        self._mgr(t0, len(keys))

    # ---- completions and request progress -----------------------------------

    def _settle(self) -> int:
        """Apply finished transfers and move requests on until nothing changes.
        Returns how many requests finished."""
        finished = 0
        while True:
            changed = self._poll()
            for run in list(self.running):
                if run.jobs:
                    continue
                if run.phase == "load":
                    self._compute_and_store(run)
                    changed = True
                if run.phase == "store" and not run.jobs:
                    self._finish(run)
                    finished += 1
                    changed = True
            if not changed:
                return finished

    def _poll(self) -> bool:
        t0 = time.perf_counter()
        results = self.worker.get_finished()
        self._worker_s += time.perf_counter() - t0
        for res in results:
            entry = self._jobs.pop(res.job_id, None)
            if entry is None:
                raise RuntimeError(f"worker reported unknown job {res.job_id}")
            run, is_load, keys, slots, seeds, lo = entry
            run.jobs.discard(res.job_id)
            c = self.c
            if self.opts.metrics is not None:
                self.opts.metrics.observe_transfer("cpu", "load" if is_load else "store",
                                                   res.transfer_size, res.transfer_time, "CPU", "LOCAL")
            if is_load:
                if res.success:
                    t0 = time.perf_counter()
                    bad = self.gpu.check(slots, seeds)
                    self._content_s += time.perf_counter() - t0
                    c["verified_blocks"] += len(slots) - len(bad)
                    if len(bad):
                        c["verify_failures"] += len(bad)
                        msg = (f"VERIFY FAILED: request {run.req.req_id}: {len(bad)} of {len(slots)} "
                               f"loaded blocks differ from what was stored (first key "
                               f"{keys[int(bad[0])].hex()}, GPU slot {int(slots[bad[0]])})")
                        if self.opts.strict:
                            raise VerificationError(msg)
                        print(msg, file=sys.stderr)
                        run.bad.extend(lo + int(i) for i in bad)
                    c["bytes_loaded"] += res.transfer_size if res.transfer_size is not None \
                        else len(slots) * self.page_bytes
                    c["load_time_s"] += res.transfer_time or 0.0
                else:
                    c["load_failures"] += len(keys)
                    run.bad.extend(range(lo, lo + len(keys)))
                t0 = time.perf_counter()
                self.manager.complete_load(keys, run.ctx)
                self._mgr(t0, len(keys))
            else:
                if res.success:
                    c["bytes_stored"] += res.transfer_size if res.transfer_size is not None \
                        else len(slots) * self.page_bytes
                    c["store_time_s"] += res.transfer_time or 0.0
                else:
                    c["store_failures"] += len(keys)
                t0 = time.perf_counter()
                self.manager.complete_store(keys, run.ctx, success=res.success)
                self._mgr(t0, len(keys))
        return bool(results)

    def _compute_and_store(self, run: _Run) -> None:
        """The prefill: write the contents of every block not loaded (and of
        loaded ones that failed), then offer the new blocks to the manager."""
        first_new = run.n_gpu + run.n_off
        idx = list(range(first_new, len(run.slots)))
        if run.bad:  # loads that failed are recomputed like any miss
            c = self.c
            redo = sorted(set(run.bad))
            tok = self.trace.block_tokens
            lost = sum(tok(run.req, i) for i in redo)
            c["offload_hit_tokens"] -= lost
            c["offload_hit_blocks"] -= len(redo)
            c["recomputed_tokens"] += lost
            idx = redo + idx
        t0 = time.perf_counter()
        slots_np = np.array(run.slots, dtype=np.int64)
        seeds = seeds_of(run.hashes)
        if idx:
            sel = np.array(idx, dtype=np.int64)
            self.gpu.fill(slots_np[sel], seeds[sel])
        self.gpu.register(run.slots[run.n_gpu:], run.hashes[run.n_gpu:])
        self._content_s += time.perf_counter() - t0
        plen = len(run.req.block_hashes)
        end = plen if self.prompt_only else len(run.keys)
        lo = 0 if run.request_level else first_new
        offer = run.keys[lo:end]
        run.phase = "store"
        if not offer:
            return
        t0 = time.perf_counter()
        out = self.manager.prepare_store(offer, run.ctx)
        self._mgr(t0, len(offer))
        c = self.c
        c["stored_blocks_offered"] += len(offer)
        if out is None:
            c["allocation_failures"] += 1
            return
        c["evicted_blocks"] += len(out.evicted_keys)
        if not out.keys_to_store:
            return
        run.stored = set(out.keys_to_store)
        pos = {k: i for i, k in enumerate(run.keys[lo:end], lo)}
        where = np.array([pos[k] for k in out.keys_to_store], dtype=np.int64)
        job = self._next_job()
        self._jobs[job] = (run, False, list(out.keys_to_store), slots_np[where], seeds[where], 0)
        t0 = time.perf_counter()
        ok = self.worker.submit_store(job, GPULoadStoreSpec(slots_np[where]), out.store_spec)
        self._worker_s += time.perf_counter() - t0
        c["store_jobs"] += 1
        if ok:
            run.jobs.add(job)
            return
        del self._jobs[job]
        c["store_failures"] += len(out.keys_to_store)
        t0 = time.perf_counter()
        self.manager.complete_store(out.keys_to_store, run.ctx, success=False)
        self._mgr(t0, len(out.keys_to_store))

    def _finish(self, run: _Run) -> None:
        mgr = self.manager
        plen = len(run.req.block_hashes)
        t0 = time.perf_counter()
        # The blocks this request reused are used once more after its new ones
        # were stored, so the request's blocks end up most recent head first.
        # Not the new ones: a touch right after the store would count as a
        # second use (and promote every block in a frequency-aware policy).
        new = run.stored
        mgr.touch([k for k in run.keys[:plen] if k not in new] if new else run.keys[:plen], run.ctx)
        mgr.on_request_finished(run.ctx)
        self._mgr(t0, plen)
        # Tail first, as vLLM frees them: the head stays cached longest.
        self.gpu.release(run.slots[::-1])
        self.running.remove(run)
        del self._seen[run.req.req_id]
        run.phase = "done"

    def _sample(self, done: int) -> None:
        self._collect_stats()
        c = self.c
        point = {"requests": done, "block_refs": c["block_refs"], "gpu_hit_blocks": c["gpu_hit_blocks"],
                 "offload_hit_blocks": c["offload_hit_blocks"],
                 "offload_hit_blocks_after_pending": c["offload_hit_blocks_after_pending"]}
        self.timeline.append(point)


def _unique_hashes(req: Request, n: int) -> list[int]:
    """Hashes for decode blocks the trace does not describe: no prompt matches them."""
    base = zlib.crc32(req.req_id.encode()) << 32
    return [mix64(base ^ (i + 0xDEC0DE)) for i in range(n)]


def _progress(total: int, enabled: bool, name: str):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=f"replay {name}", unit="req", file=sys.stderr, mininterval=0.5)


def replay(trace: Trace, opts: EngineOptions) -> ReplayResult:
    engine = ReplayEngine(trace, opts)
    try:
        return engine.run()
    finally:
        engine.close()
