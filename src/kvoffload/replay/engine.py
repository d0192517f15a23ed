"""A simulated engine step loop that drives a real OffloadingSpec (manager and
worker) the way vLLM's scheduler and model runner do.

Per request: prompt blocks already on the GPU are hits; the rest are looked
up in the offload manager in prefix order up to the first miss (HIT_PENDING
or RETRY delay the request a step); hits are loaded with real byte copies
and checked byte for byte; newly computed blocks get contents derived from
their hash and are stored; then the request finishes and its GPU blocks
become idle prefix-cache entries (evicted LRU).

Two call orders (`order`):
- "vllm" (default): the order of vLLM 0.32/0.33's Scheduler and
  OffloadingConnector. Per step: lookups and prepare_load for waiting
  requests (schedule), on_schedule_end, prepare_store for the blocks computed
  this step and the final ones of requests that finished last step, then
  on_request_finished for those (build_connector_meta); then the model step;
  then complete_load/complete_store for the jobs submitted the step before
  (update_connector_output: every job lands exactly one step after its
  submission, so a run does not depend on thread timing). No touch (vLLM
  never calls it): managers record recency themselves. A request finishes
  while its stores are in flight; its GPU blocks are freed at once and
  fenced: a store still reading a block is waited for before the block is
  written again. Options:
  preempt_every (the newest decoding request loses its GPU blocks and
  waits again; its stores are flushed), abort_every (every N-th request is
  aborted the step it is scheduled, loads in flight included), reset_every
  (vLLM's reset_cache: finished requests signalled, manager.reset_cache(),
  jobs in flight flushed and their completions dropped, running requests
  store again from their first block, then on_reset_flushed if the manager
  has it).
- "legacy": a request's stores complete before it finishes, and blocks are
  touched at scheduling and finish. With no GPU cache and
  one request at a time (the defaults) this is exactly the reference
  semantics of the trace README, so the offload tier's prefix hit rate is
  comparable to its LRU/OPT table and to `kvoffload.replay.oracle`.
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
    order: str = "vllm"  # "vllm" or "legacy" (see the module docstring)
    preempt_every: int = 0  # vllm order: preempt the newest decoding request every N steps (once per request)
    abort_every: int = 0  # vllm order: abort every N-th request when it is scheduled
    reset_every: int = 0  # vllm order: reset_cache() before every N-th step
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
    index: int = 0  # arrival order
    pending: set[bytes] = field(default_factory=set)  # keys that answered HIT_PENDING/RETRY
    # transfer jobs in flight (vLLM's transfer_jobs: a request with any is not looked up)
    jobs: set[int] = field(default_factory=set)
    offered: int = 0  # keys before this were offered to prepare_store (vLLM's next_stored_chunk_idx)
    # tiered specs: keys the CPU tier lacked at first sight, and the step, so a
    # hit on one of them that the engine did not store since was promoted
    absent: set[bytes] | None = None
    first_step: int = 0
    preempted: bool = False


@dataclass
class _Run:
    req: Request
    ctx: ReqContext
    keys: list[bytes]  # prompt keys, then decode keys
    hashes: list[int]
    slots: list[int]
    n_gpu: int
    n_off: int
    # legacy: load -> store -> done; vllm: loading -> loaded -> prefill -> decode -> done
    phase: str = "load"
    jobs: set[int] = field(default_factory=set)  # vllm order: the _Seen's set
    request_level: bool = False
    bad: list[int] = field(default_factory=list)  # loaded block indices that failed
    stored: set[bytes] = field(default_factory=set)  # keys this request stored
    promoted: set[int] = field(default_factory=set)  # loaded block indices a lower tier supplied
    seen: _Seen | None = None
    computed: int = 0  # vllm order: leading keys whose KV is on the GPU
    left: int = 0  # vllm order: decode steps left
    aborted: bool = False
    first_step: int = 0  # the step it was scheduled
    resumed: bool = False  # rescheduled after a preemption


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
        if opts.order not in ("vllm", "legacy"):
            raise ConfigError(f"order must be 'vllm' or 'legacy', got {opts.order!r}")
        for name in ("preempt_every", "abort_every", "reset_every"):
            v = getattr(opts, name)
            if not isinstance(v, int) or v < 0:
                raise ConfigError(f"{name} must be 0 (off) or a positive number of steps, got {v!r}")
            if v and opts.order != "vllm":
                raise ConfigError(f"{name} needs order 'vllm' (got order {opts.order!r})")
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
        # A composing manager over a CPU tier: hits are attributed to the tier
        # they came from (see _Seen.absent).
        self._primary = getattr(self.manager, "primary", None) if getattr(self.manager, "tiers", None) else None
        self._cpu_stored: dict[bytes, int] = {}  # key -> step the engine's store of it landed
        self._job_id = 0
        self._job_step: dict[int, int] = {}  # vllm order: job -> step it was submitted
        self._held: list = []  # vllm order: results of jobs submitted this step, applied next step
        self._stale: set[int] = set()  # jobs in flight at a reset: completions dropped
        self._fence: dict[int, int] = {}  # GPU slot -> store job that may still read it
        self.finishing: list[_Run] = []  # vllm order: finished, on_request_finished next step
        self._zombies: list[_Run] = []  # aborted while loading: slots freed when the load lands
        self._to_submit: list[tuple] = []  # vllm order: loads prepared, for this step's worker phase
        self._arrived = 0
        self._jobs: dict[int, tuple[_Run, bool, list[bytes], np.ndarray, np.ndarray, int]] = {}
        self.c: dict[str, float] = dict.fromkeys((
            "requests", "prompt_tokens", "block_refs", "gpu_hit_blocks", "offload_hit_blocks",
            "offload_hit_blocks_after_pending", "offload_hit_blocks_promoted", "idle_waits",
            "gpu_hit_tokens", "offload_hit_tokens", "recomputed_tokens", "stored_blocks_offered",
            "store_jobs", "load_jobs", "bytes_loaded", "bytes_stored", "load_time_s", "store_time_s",
            "evicted_blocks", "allocation_failures", "delayed_lookups", "delay_timeouts",
            "load_failures", "store_failures", "verify_failures", "verified_blocks",
            "gpu_evictions", "steps", "sim_time_ms", "preemptions", "aborts", "resets",
            "stale_completions", "fence_waits", "delayed_for_transfers",
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
        legacy = opts.order == "legacy"
        # vllm order: after the last request, keep stepping until its
        # on_request_finished and every completion have been delivered
        while done < total or not legacy and (self.finishing or self._zombies or self._jobs or self._held):
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
            if legacy:
                new_ids = self._schedule(waiting)
                t0 = time.perf_counter()
                self.manager.on_schedule_end(ScheduleEndContext(new_ids, ()))
                self._mgr_s += time.perf_counter() - t0
                if opts.events is not None:
                    opts.events.publish(self.manager.take_events())
                finished = self._settle()
                if not finished and not new_ids:
                    self._idle_wait()
                    finished = self._settle()
            else:
                finished = self._vllm_step(waiting)
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

    def _idle_wait(self) -> None:
        """Nothing to compute: wait for our transfers, or give the tiers' threads time."""
        t0 = time.perf_counter()
        if self._jobs:
            self.worker.wait(set(self._jobs))
            self._worker_s += time.perf_counter() - t0
        else:  # only the tiers are busy (promotions): let their threads run
            time.sleep(self.opts.idle_sleep_s)
            self._idle_s += time.perf_counter() - t0
            self.c["idle_waits"] += 1

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
        """Start waiting requests while there is room (lookups, GPU blocks,
        prepare_load); returns their ids."""
        new_ids: list[str] = []
        self._step_tokens = 0  # tokens prefilled this step (the simulated clock)
        mgr = self.manager
        c = self.c
        vllm = self.opts.order == "vllm"
        step = int(c["steps"])
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
                seen = self._seen[req.req_id] = _Seen(ctx, keys, roc.policy == OffloadPolicy.REQUEST_LEVEL,
                                                      index=self._arrived, first_step=step)
                self._arrived += 1
                if self._primary is not None:
                    slot_of = self._primary.slot_of
                    seen.absent = {k for k in keys if slot_of(k) is None}
            if seen.jobs:  # vLLM looks a request up only once its transfers have landed
                c["delayed_for_transfers"] += 1
                skipped.append((req, delays))
                continue
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
            fresh = self._allocate(len(hashes) - n_gpu + n_dec)
            if fresh is None:  # running requests hold the GPU: try next step
                waiting.appendleft((req, delays))
                break
            slots = self.gpu.acquire(hashes[:n_gpu]) + fresh
            if n_dec:
                dec = req.decode_hashes if req.decode_hashes is not None else _unique_hashes(req, n_dec)
                keys = keys + [h.to_bytes(8, "big") + _GROUP0 for h in dec]
                hashes = hashes + list(dec)
            run = _Run(req, ctx, keys, hashes, slots, n_gpu, n_off, request_level=seen.request_level,
                       jobs=seen.jobs, seen=seen, first_step=step, resumed=seen.preempted)
            self.running.append(run)
            new_ids.append(req.req_id)
            plen = len(req.block_hashes)
            if vllm:
                # vLLM's update_state_after_alloc: a chunk-level request stores
                # from past its hits; without an external hit, from its start
                if n_off and not seen.request_level:
                    seen.offered = n_gpu + n_off
                run.phase = "loading" if n_off else "prefill"
            else:
                # vLLM touches every block of the request, GPU-cached ones too; before
                # the store below, so this request's own blocks are not its victims.
                t0 = time.perf_counter()
                mgr.touch(keys[:plen], ctx)
                self._mgr(t0, plen)
            if not seen.preempted:
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
            if seen.absent is not None and n_off:
                # the CPU tier lacked it at first sight and the engine did not
                # store it since: a lower tier supplied it (look-ahead included)
                absent, stored, since = seen.absent, self._cpu_stored, seen.first_step
                run.promoted = {i for i in range(n_gpu, n_gpu + n_off)
                                if keys[i] in absent and stored.get(keys[i], -1) < since}
                c["offload_hit_blocks_promoted"] += len(run.promoted)
            tok = self.trace.block_tokens
            g_tok = sum(tok(req, i) for i in range(n_gpu))
            o_tok = sum(tok(req, i) for i in range(n_gpu, n_gpu + n_off))
            c["gpu_hit_tokens"] += g_tok
            c["offload_hit_tokens"] += o_tok
            c["recomputed_tokens"] += req.prompt_tokens - g_tok - o_tok
            self._step_tokens += req.prompt_tokens - g_tok - o_tok
            if n_off:
                self._prepare_load(run)
        waiting.extendleft(reversed(skipped))
        return new_ids

    def _allocate(self, n: int) -> list[int] | None:
        """Fresh GPU slots; a store still reading one of them is waited for
        first (vLLM's flush of a job whose blocks are re-allocated)."""
        fresh = self.gpu.allocate(n)
        if fresh and self._fence:
            fence = self._fence
            jobs = {fence.pop(s) for s in fresh if s in fence}
            jobs.intersection_update(self._jobs)
            if jobs:
                self.c["fence_waits"] += 1
                t0 = time.perf_counter()
                self.worker.wait(jobs)
                self._worker_s += time.perf_counter() - t0
        return fresh

    def _prepare_load(self, run: _Run) -> None:
        """prepare_load now; the worker gets the job now (legacy) or in this
        step's worker phase (vllm order, after the flushed stores)."""
        lo, hi = run.n_gpu, run.n_gpu + run.n_off
        keys = run.keys[lo:hi]
        t0 = time.perf_counter()
        src = self.manager.prepare_load(keys, run.ctx)
        self._mgr(t0, len(keys))
        job = (run, True, keys, np.array(run.slots[lo:hi], dtype=np.int64), seeds_of(run.hashes[lo:hi]), lo, src)
        if self.opts.order == "vllm":
            self._to_submit.append(job)
        else:
            self._submit(job)

    def _submit(self, job: tuple) -> int | None:
        """Hand a prepared load or store to the worker; a refused job is
        completed as failed at once. Returns the job id, None if refused."""
        run, is_load, keys, slots, seeds, lo, spec = job
        job_id = self._next_job()
        self._jobs[job_id] = (run, is_load, keys, slots, seeds, lo)
        self._job_step[job_id] = int(self.c["steps"])
        t0 = time.perf_counter()
        if is_load:
            ok = self.worker.submit_load(job_id, spec, GPULoadStoreSpec(slots))
        else:
            ok = self.worker.submit_store(job_id, GPULoadStoreSpec(slots), spec)
        self._worker_s += time.perf_counter() - t0
        c = self.c
        c["load_jobs" if is_load else "store_jobs"] += 1
        if ok:
            run.jobs.add(job_id)
            return job_id
        del self._jobs[job_id]
        self._job_step.pop(job_id, None)
        t0 = time.perf_counter()
        if is_load:  # unpin and recompute those blocks
            c["load_failures"] += len(keys)
            run.bad.extend(range(lo, lo + len(keys)))
            if run.phase == "loading" and not run.jobs:
                run.phase = "loaded"
            self.manager.complete_load(keys, run.ctx)
        else:
            c["store_failures"] += len(keys)
            self.manager.complete_store(keys, run.ctx, success=False)
        self._mgr(t0, len(keys))
        return None

    # ---- vLLM's order -------------------------------------------------------

    def _vllm_step(self, waiting: deque) -> int:
        """One engine step in vLLM's order; returns how many requests finished."""
        opts, c, mgr = self.opts, self.c, self.manager
        step = int(c["steps"])
        if opts.reset_every and step % opts.reset_every == 0:
            self._reset()  # between steps, as reset_prefix_cache runs
        # Scheduler.schedule(): running requests first (one may be preempted),
        # then requests whose loads landed, then the waiting queue
        preempted: list[str] = []
        if opts.preempt_every and step % opts.preempt_every == 0:
            # once per request at most: a long decode preempted every N steps would never finish
            victim = next((r for r in reversed(self.running) if r.phase == "decode" and not r.resumed), None)
            if victim is not None:
                self._preempt(victim, waiting)
                preempted.append(victim.req.req_id)
        for run in self.running:
            if run.phase == "loaded":
                run.phase = "prefill"
        self._schedule(waiting)
        new_ids = [r.req.req_id for r in self.running if r.phase == "prefill" and not r.resumed]
        # build_connector_meta(): on_schedule_end, stores of what this step
        # computes and of the requests that finished last step, then their
        # on_request_finished
        t0 = time.perf_counter()
        mgr.on_schedule_end(ScheduleEndContext(new_ids, preempted))
        self._mgr_s += time.perf_counter() - t0
        loads, self._to_submit = self._to_submit, []
        stores: list[tuple] = []
        computing: list[_Run] = []
        for run in self.running:
            if run.phase == "prefill":
                run.computed = len(run.req.block_hashes)
            elif run.phase == "decode":
                run.computed += 1
            else:
                continue
            computing.append(run)
            self._offer_vllm(run, run.computed, stores)
        flush: list[tuple] = []
        finishing, self.finishing = self.finishing, []
        for run in finishing:
            if not run.aborted:
                self._offer_vllm(run, len(run.keys), flush)
        for run in finishing:  # after every prepare_store of the step
            t0 = time.perf_counter()
            mgr.on_request_finished(run.ctx)
            self._mgr(t0, 1)
            self._seen.pop(run.req.req_id, None)
        if opts.events is not None:
            opts.events.publish(mgr.take_events())
        # the worker: a finished request's last stores read GPU blocks that may
        # be re-allocated this step, so they are flushed (run and waited for)
        # before anything writes blocks: then loads, the forward pass, stores
        if flush:
            ids = {j for j in map(self._submit, flush) if j is not None}
            if ids:
                self.c["fence_waits"] += 1
                t0 = time.perf_counter()
                self.worker.wait(ids)
                self._worker_s += time.perf_counter() - t0
        for job in loads:
            self._submit(job)
        for run in computing:
            if run.phase == "prefill":
                self._compute(run)
        for job in stores:
            self._submit(job)
        # update_from_output(): requests move on or finish, then the jobs
        # submitted in earlier steps complete
        finished = 0
        every = opts.abort_every
        for run in list(self.running):
            if every and run.first_step == step and not run.resumed and run.seen.index % every == every - 1:
                self._abort(run)
                finished += 1
                continue
            if run.phase == "prefill":
                run.phase = "decode"
                run.left = len(run.keys) - len(run.req.block_hashes)
            elif run.phase == "decode":
                run.left -= 1
            else:
                continue
            if run.left <= 0:
                self._release(run)
                run.phase = "done"
                self.finishing.append(run)
                finished += 1
        progressed = self._poll()
        if not computing and not finished and not progressed:
            self._idle_wait()
            self._poll()
        for run in [r for r in self._zombies if not r.jobs]:
            self._zombies.remove(run)
            self.gpu.release(run.slots[::-1])
        return finished

    def _offer_vllm(self, run: _Run, computed: int, jobs: list) -> None:
        """prepare_store of the computed keys not offered yet (vLLM's
        _build_store_jobs); a refused store is offered again next step."""
        seen = run.seen
        end = min(computed, len(run.req.block_hashes) if self.prompt_only else len(run.keys))
        if end > seen.offered and self._offer(run, seen.offered, end, jobs):
            seen.offered = end

    def _release(self, run: _Run) -> None:
        """Free a request's GPU blocks, tail first as vLLM frees them (the
        head stays cached longest), fencing those its stores still read."""
        fence = self._fence
        for job in run.jobs:
            entry = self._jobs.get(job)
            if entry is not None and not entry[1]:
                for s in entry[3].tolist():
                    fence[s] = job
        self.running.remove(run)
        self.gpu.release(run.slots[::-1])

    def _preempt(self, run: _Run, waiting: deque) -> None:
        """The request loses its GPU blocks and waits again at the head of the
        queue; vLLM flushes its stores before the blocks are reused."""
        self.c["preemptions"] += 1
        if run.jobs:
            t0 = time.perf_counter()
            self.worker.wait(set(run.jobs))
            self._worker_s += time.perf_counter() - t0
        self.running.remove(run)
        self.gpu.release(run.slots[::-1])
        run.phase = "done"
        run.seen.preempted = True
        waiting.appendleft((run.req, 0))

    def _abort(self, run: _Run) -> None:
        """Aborted: finished (on_request_finished next step) with nothing more
        to store; a load in flight keeps its GPU blocks until it lands."""
        self.c["aborts"] += 1
        run.aborted = True
        if run.phase == "loading" and run.jobs:
            self.running.remove(run)
            self._zombies.append(run)
        else:
            self._release(run)
        run.phase = "done"
        self.finishing.append(run)

    def _reset(self) -> None:
        """vLLM's OffloadingConnectorScheduler.reset_cache: finished requests
        are signalled, the manager resets, every job in flight becomes stale
        (the workers flush it; its completion never reaches the manager), and
        running requests store again from their first block."""
        mgr, c = self.manager, self.c
        c["resets"] += 1
        t0 = time.perf_counter()
        for run in self.finishing:
            mgr.on_request_finished(run.ctx)
            self._seen.pop(run.req.req_id, None)
        self.finishing = []
        mgr.reset_cache()
        self._mgr(t0, 1)
        self._stale.update(self._jobs)
        for seen in self._seen.values():
            seen.offered = 0
            seen.jobs.clear()
        for run in self._zombies:
            run.jobs.clear()
        if self._jobs:
            t0 = time.perf_counter()
            self.worker.wait(set(self._jobs))
            self._worker_s += time.perf_counter() - t0
            while self._jobs.keys() & self._stale:
                self._poll()
        flushed = getattr(mgr, "on_reset_flushed", None)
        if flushed is not None:  # the contract's hook: the flush is done
            t0 = time.perf_counter()
            flushed()
            self._mgr(t0, 1)

    # ---- completions and request progress -----------------------------------

    def _settle(self) -> int:
        """Legacy order: apply finished transfers and move requests on until
        nothing changes. Returns how many requests finished."""
        finished = 0
        while True:
            changed = self._poll()
            for run in list(self.running):
                if run.jobs:
                    continue
                if run.phase == "load":
                    self._compute(run)
                    plen = len(run.req.block_hashes)
                    first_new = run.n_gpu + run.n_off
                    lo = 0 if run.request_level else first_new
                    job: list[tuple] = []
                    self._offer(run, lo, plen if self.prompt_only else len(run.keys), job)
                    for j in job:
                        self._submit(j)
                    run.phase = "store"
                    changed = True
                if run.phase == "store" and not run.jobs:
                    self._finish(run)
                    finished += 1
                    changed = True
            if not changed:
                return finished

    def _poll(self) -> bool:
        t0 = time.perf_counter()
        vllm = self.opts.order == "vllm"
        if vllm:
            # Every job submitted before this step completes in this step,
            # never later: the run does not depend on the copy thread's speed.
            step = self.c["steps"]
            due = {j for j, s in self._job_step.items() if s < step}
            if due:
                self.worker.wait(due)
        results = self.worker.get_finished()
        self._worker_s += time.perf_counter() - t0
        if vllm:  # completions reach the manager in a later step than their submission
            held, self._held = self._held, []
            self._held = [r for r in results if self._job_step.get(r.job_id) == step]
            results = held + [r for r in results if self._job_step.get(r.job_id) != step]
        for res in results:
            entry = self._jobs.pop(res.job_id, None)
            if entry is None:
                raise RuntimeError(f"worker reported unknown job {res.job_id}")
            self._job_step.pop(res.job_id, None)
            stale = res.job_id in self._stale
            if stale:
                self._stale.discard(res.job_id)
                self.c["stale_completions"] += 1
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
                if run.phase == "loading" and not run.jobs:
                    run.phase = "loaded"
                if not stale:  # after a reset vLLM drops the completions of jobs in flight
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
                if not stale:
                    t0 = time.perf_counter()
                    self.manager.complete_store(keys, run.ctx, success=res.success)
                    self._mgr(t0, len(keys))
                    if res.success and self._primary is not None:
                        step = int(c["steps"])
                        cpu_stored = self._cpu_stored
                        for k in keys:
                            cpu_stored[k] = step
        return bool(results)

    def _compute(self, run: _Run) -> None:
        """The prefill: write the contents of every block not loaded (and of
        loaded ones that failed); the blocks become GPU prefix-cache entries."""
        first_new = run.n_gpu + run.n_off
        idx = list(range(first_new, len(run.slots)))
        if run.bad:  # loads that failed are recomputed like any miss
            c = self.c
            redo = sorted(set(run.bad))
            tok = self.trace.block_tokens
            lost = sum(tok(run.req, i) for i in redo)
            c["offload_hit_tokens"] -= lost
            c["offload_hit_blocks"] -= len(redo)
            c["offload_hit_blocks_promoted"] -= len(run.promoted.intersection(redo))
            c["recomputed_tokens"] += lost
            idx = redo + idx
        t0 = time.perf_counter()
        if idx:
            sel = np.array(idx, dtype=np.int64)
            self.gpu.fill(np.array(run.slots, dtype=np.int64)[sel], seeds_of(run.hashes)[sel])
        self.gpu.register(run.slots[run.n_gpu:], run.hashes[run.n_gpu:])
        self._content_s += time.perf_counter() - t0

    def _offer(self, run: _Run, lo: int, end: int, jobs: list) -> bool:
        """prepare_store of run.keys[lo:end]; the store job for the keys the
        manager takes is appended to `jobs` for _submit. False if refused."""
        offer = run.keys[lo:end]
        if not offer:
            return True
        t0 = time.perf_counter()
        out = self.manager.prepare_store(offer, run.ctx)
        self._mgr(t0, len(offer))
        c = self.c
        c["stored_blocks_offered"] += len(offer)
        if out is None:
            c["allocation_failures"] += 1
            return False
        c["evicted_blocks"] += len(out.evicted_keys)
        if not out.keys_to_store:
            return True
        run.stored.update(out.keys_to_store)
        pos = {k: i for i, k in enumerate(offer, lo)}
        where = np.array([pos[k] for k in out.keys_to_store], dtype=np.int64)
        jobs.append((run, False, list(out.keys_to_store), np.array(run.slots, dtype=np.int64)[where],
                     seeds_of(run.hashes)[where], 0, out.store_spec))
        return True

    def _finish(self, run: _Run) -> None:
        """Legacy order: the request's stores have landed."""
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
                 "offload_hit_blocks_after_pending": c["offload_hit_blocks_after_pending"],
                 "offload_hit_blocks_promoted": c["offload_hit_blocks_promoted"]}
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
