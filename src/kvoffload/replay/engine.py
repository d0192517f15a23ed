"""A simulated engine step loop that drives a real OffloadingSpec (manager and
worker) the way vLLM's scheduler and model runner do.

Per request: prompt blocks already on the GPU are hits; the rest are looked
up in the offload manager in prefix order up to the first miss (HIT_PENDING
or RETRY delay the request a step); hits are loaded with real byte copies
and checked (replay/contents.py); newly computed blocks get contents derived
from their hash and are stored; then the request finishes and its GPU blocks
become idle prefix-cache entries (evicted LRU).

Two call orders (`order`):
- "vllm" (default): the order of vLLM 0.32/0.33's Scheduler and
  OffloadingConnector (replay/vllm_order.py).
- "legacy": a request's stores complete before it finishes, and blocks are
  touched at scheduling and finish. With no GPU cache and
  one request at a time (the defaults) this is exactly the reference
  semantics of the trace README, so the offload tier's prefix hit rate is
  comparable to its LRU/OPT table and to `kvoffload.replay.oracle`.

The parts: scheduling.py (lookups, GPU blocks, prepare_load), transfers.py
(the job table: submissions, completions, load checks), vllm_order.py,
timing.py (the manager and worker are called through timed proxies: the
manager's and worker's share of the time), contents.py, gpu.py, state.py.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvoffload.abstractions import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    ScheduleEndContext,
)
from kvoffload.config import CacheConfig, ConfigError, KVGroupConfig, OffloadingConfig
from kvoffload.replay.contents import BlockContents
from kvoffload.replay.engine_time import EngineTime
from kvoffload.replay.gpu import GPUBlocks
from kvoffload.replay.legacy_order import LegacyOrder
from kvoffload.replay.scheduling import Scheduling
from kvoffload.replay.state import Job, Running
from kvoffload.replay.timing import Stopwatch, TimedManager, TimedWorker
from kvoffload.replay.traces import Request, Trace
from kvoffload.replay.transfers import Transfers, VerificationError
from kvoffload.replay.vllm_order import VllmOrder
from kvoffload.spec import build_spec

__all__ = ["EngineOptions", "ReplayEngine", "ReplayResult", "VerificationError", "replay"]

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
    # engine time (engine_time.py): "engine" paces the tiers below CPU on a
    # simulated clock at the compute time of each step; "fast": no clock
    time_model: str = "fast"
    decode_tokens_per_s: float = 3_000.0
    model_kv_bytes_per_token: int = 128 * 1024  # KV bytes a tier moves per token (engine time)
    tier_bandwidth: dict[str, float] | None = None  # tier name -> bytes/s (else by its kind)
    max_delay_steps: int = 1000  # then a pending lookup counts as a miss
    # vLLM's chunked prefill (vllm order): prompt tokens computed per step, so
    # a long prompt is stored a chunk a step, as vLLM's connector stores it
    # (vLLM's default budget is 8192); 0: each prompt whole in one step, the
    # replay's model before this option (and still its default: the
    # documented figures were measured so)
    max_batched_tokens: int = 0
    idle_sleep_s: float = 0.0002  # a step with nothing to do sleeps this long
    # Let the tiers finish their own work (cascading stores) after each step,
    # as an engine whose compute time covers it: deterministic, slower
    sync_tiers: bool = False
    samples: int = 100  # points of the hit-rate-over-time series
    strict: bool = False  # raise on the first byte mismatch instead of counting it
    verify: str = "sample"  # "sample": a sample of every loaded block's bytes; "all": every byte
    order: str = "vllm"  # "vllm" or "legacy" (see the module docstring)
    # False: a CPU worker copies each job in the step loop's thread as it is
    # submitted (the same plan and copy code, reported through get_finished
    # as before; both orders apply a completion no earlier than with a
    # thread, so the run is the same, without two thread hand-offs per job).
    # True: on the worker's own copy thread, as in an engine.
    copy_thread: bool = False
    preempt_every: int = 0  # vllm order: preempt the newest decoding request every N steps (once per request)
    abort_every: int = 0  # vllm order: abort every N-th request when it is scheduled
    reset_every: int = 0  # vllm order: reset_cache() before every N-th step
    progress: bool = True
    # Where the progress bar goes: a label after the trace name, and a line
    # of its own (tqdm's position) when several replays run at once.
    progress_label: str = ""
    progress_position: int | None = None
    # Observability (off by default, inert when off): a PrometheusMetrics to
    # feed with the manager's stats and the worker's transfers, and a
    # ZmqEventPublisher for the manager's KV events.
    metrics: Any = None
    events: Any = None


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
    manager_calls_s: dict[str, float] = field(default_factory=dict)  # manager_s by method

    @property
    def harness_s(self) -> float:
        return max(0.0, self.wall_s - self.manager_s - self.worker_s - self.idle_s)


COUNTERS = (
    "requests", "prompt_tokens", "block_refs", "gpu_hit_blocks", "offload_hit_blocks",
    "offload_hit_blocks_after_pending", "offload_hit_blocks_promoted", "idle_waits",
    "gpu_hit_tokens", "offload_hit_tokens", "recomputed_tokens", "stored_blocks_offered",
    "store_jobs", "load_jobs", "bytes_loaded", "bytes_stored", "load_time_s", "store_time_s",
    "evicted_blocks", "allocation_failures", "delayed_lookups", "delay_timeouts",
    "load_failures", "store_failures", "verify_failures", "verified_blocks",
    "gpu_evictions", "steps", "sim_time_ms", "preemptions", "aborts", "resets",
    "stale_completions", "fence_waits", "delayed_for_transfers", "compute_s", "tier_wait_s",
)


def _check_options(opts: EngineOptions, block_size: int) -> None:
    page = opts.kv_bytes_per_token * block_size
    if opts.kv_bytes_per_token <= 0 or page % 8:
        raise ConfigError(f"kv_bytes_per_token * block_size must be a positive multiple of 8, "
                          f"got {opts.kv_bytes_per_token} * {block_size}")
    if opts.max_running <= 0:
        raise ConfigError(f"max_running must be positive, got {opts.max_running}")
    if opts.time_model not in ("engine", "fast"):
        raise ConfigError(f"time_model must be 'engine' or 'fast', got {opts.time_model!r}")
    for name in ("time_compression", "prefill_tokens_per_s", "decode_tokens_per_s", "model_kv_bytes_per_token"):
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
    mbt = opts.max_batched_tokens
    if not isinstance(mbt, int) or mbt < 0 or 0 < mbt < block_size:
        raise ConfigError(f"max_batched_tokens must be 0 (each prompt in one step) or at least one block "
                          f"({block_size} tokens), got {mbt!r}")
    if mbt and opts.order != "vllm":
        raise ConfigError(f"max_batched_tokens needs order 'vllm' (got order {opts.order!r})")


class ReplayEngine(Scheduling, Transfers, VllmOrder, LegacyOrder, EngineTime):
    def __init__(self, trace: Trace, opts: EngineOptions):
        self.trace = trace
        self.opts = opts
        bs = trace.block_size
        _check_options(opts, bs)
        page = opts.kv_bytes_per_token * bs
        self.page_bytes = page
        config = OffloadingConfig(
            groups=(KVGroupConfig(tokens_per_block=bs),),
            cache=CacheConfig(tokens_per_hash=bs, blocks_per_chunk=1),
            extra_config=dict(opts.extra_config),
            enable_kv_cache_events=opts.events is not None,
        )
        if opts.spec == "tiered":  # a wall-clock deadline would make the figures depend on the machine's load
            config.extra_config.setdefault("promotion_deadline_s", None)
        self.spec = build_spec(opts.spec, config)
        encoder = getattr(opts.events, "encoder", None)
        if encoder is not None and not encoder.block_size:  # routers read tokens per block from events
            encoder.block_size = bs
        self.prompt_only = self.spec.offload_prompt_only
        # Room for every running request at its largest, plus the cache.
        biggest = max(len(r.block_hashes) + self._num_decode_blocks(r) for r in trace.requests)
        num_gpu = opts.gpu_blocks + opts.max_running * max(1, biggest)
        # With no GPU cache and one request at a time no request can match
        # another's blocks: the GPU need not know which hash a slot holds.
        self.gpu = GPUBlocks(num_gpu, page, opts.gpu_blocks, shared=opts.max_running > 1)
        self.contents = BlockContents(self.gpu.words, opts.verify)
        kv = CanonicalKVCaches(
            tensors=[CanonicalKVCacheTensor(self.gpu.tensor, page)],
            group_data_refs=[[CanonicalKVCacheRef(tensor_idx=0, page_size_bytes=page)]],
        )
        # Worker first: a spec sized in bytes learns its chunk size from the KV caches.
        self.worker = self.spec.get_worker(kv)
        self.manager = self.spec.get_manager()
        inline = getattr(self.worker, "run_copies_inline", None)
        self.copies_inline = not opts.copy_thread and inline is not None and inline()
        # The engine calls both through timed proxies (their share of the time).
        try:
            self._install_clock()  # (engine time: the tiers' workers paced by a simulated clock)
        except ConfigError:
            self.close()
            raise
        self.mgr = TimedManager(self.manager)
        self.wrk = TimedWorker(self.worker)
        self._content = Stopwatch()  # writing and checking block contents
        self._idle = Stopwatch()  # sleeping while only the tiers' threads work
        # A composing manager over a CPU tier: hits are attributed to the tier
        # they came from (see Seen.absent).
        self._primary = getattr(self.manager, "primary", None) if getattr(self.manager, "tiers", None) else None
        self._cpu_stored: dict[bytes, int] = {}  # key -> step the engine's store of it landed
        self._last_by_head: dict[int, tuple] = {}  # first block's seed -> (seeds, keys) of the last such request
        self._job_id = 0
        self._job_step: dict[int, int] = {}  # vllm order: job -> step it was submitted
        self._held: list = []  # vllm order: results of jobs submitted this step, applied next step
        self._stale: set[int] = set()  # jobs in flight at a reset: completions dropped
        # GPU slot -> the store job that may still read it (0: none); set when a
        # request frees its slots, cleared when they are allocated again
        self._fence = np.zeros(num_gpu, dtype=np.int64)
        self.finishing: list[Running] = []  # vllm order: finished, on_request_finished next step
        self._zombies: list[Running] = []  # aborted while loading: slots freed when the load lands
        self._to_submit: list[Job] = []  # vllm order: loads prepared, for this step's worker phase
        self._arrived = 0
        self._step_tokens = 0
        self._jobs: dict[int, Job] = {}  # submitted, not completed
        self.c: dict[str, float] = dict.fromkeys(COUNTERS, 0)
        self.c["longest_prompt_blocks"] = max(len(r.block_hashes) for r in trace.requests)
        half = getattr(self._primary, "num_chunks", 0) // 2  # what promotions may hold (tiering/promotion.py)
        if half:  # prompt blocks the tiers below can never return: past half of CPU
            self.c["blocks_beyond_half_cpu"] = sum(max(0, len(r.block_hashes) - half) for r in trace.requests)
        self._tiers: dict[str, dict[str, Any]] = {}
        self.timeline: list[dict[str, float]] = []

    # ---- helpers ------------------------------------------------------------

    def _num_decode_blocks(self, r: Request) -> int:
        if r.decode_hashes is not None:
            return len(r.decode_hashes)
        bs = self.trace.block_size
        return max(0, (r.prompt_tokens + r.output_tokens) // bs - len(r.block_hashes))

    def tokens_in(self, req: Request, lo: int, hi: int) -> int:
        """Prompt tokens of blocks lo..hi-1 (the last block may be partial)."""
        bs = self.trace.block_size
        return max(0, min(req.prompt_tokens, hi * bs) - lo * bs) if hi > lo else 0

    def _next_job(self) -> int:
        self._job_id += 1
        return self._job_id

    def _collect_stats(self) -> None:
        st = self.mgr.get_stats()
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
        self.running: list[Running] = []
        self._seen = {}  # req_id -> Seen: requests looked at, not finished
        done = 0
        sample_at = max(1, total // max(1, opts.samples))
        bar = _progress(total, opts, self.trace.name)
        # What the tiers hold before the first request: a storage tier opens
        # with the blocks an earlier run left in its directory (a warm start)
        self._collect_stats()
        for t in self._tiers.values():
            t["blocks_at_start"] = int(t["gauges"].get("used_blocks", 0))
        now = 0.0
        t_start = time.perf_counter()
        cpu_start = time.process_time()
        legacy = opts.order == "legacy"
        # vllm order: after the last request, keep stepping until its
        # on_request_finished and every completion have been delivered
        while done < total or not legacy and (self.finishing or self._zombies or self._jobs or self._held):
            self.c["steps"] += 1
            # admit arrivals
            if opts.arrival == "asap":
                while arrivals and len(waiting) < opts.max_running + 64:
                    waiting.append((arrivals.popleft(), 0))
            else:
                if not waiting and not self.running and arrivals:
                    now = max(now, arrivals[0].arrival_ms / opts.time_compression)
                    if self.clock is not None:  # the tiers worked through the idle gap
                        self.clock.now_s = max(self.clock.now_s, now / 1000.0)
                while arrivals and arrivals[0].arrival_ms / opts.time_compression <= now:
                    waiting.append((arrivals.popleft(), 0))
            if opts.sync_tiers:
                self._drain_tiers()
            if legacy:
                new_ids = self._schedule(waiting)
                self.mgr.on_schedule_end(ScheduleEndContext(new_ids, ()))
                if opts.events is not None:
                    opts.events.publish(self.manager.take_events())
                finished = self._settle()
                self._step_busy = bool(new_ids or finished)
                if not finished and not new_ids:
                    self._idle_wait()
                    finished = self._settle()
            else:
                finished = self._vllm_step(waiting)
            now = self._advance_clock(now)
            for _ in range(finished):
                done += 1
                if done % sample_at == 0 or done == total:
                    self._sample(done)
            if bar is not None and finished:
                bar.update(finished)
        self._finish_clock()
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
        for name, t in self.time_report().items():
            self._tiers.setdefault(name, {"counters": {}, "gauges": {}})["engine_time"] = t
        return ReplayResult(
            trace=self.trace.name,
            options={k: v for k, v in vars(opts).items() if not k.startswith("progress")} | {
                "block_size": self.trace.block_size, "page_bytes": self.page_bytes,
                "offload_prompt_only": self.prompt_only, "copies_inline": self.copies_inline},
            counters=dict(self.c),
            tiers=self._tiers,
            manager_ns_per_block=self.mgr.ns_per_block(),
            timeline=self.timeline,
            wall_s=wall, manager_s=self.mgr.seconds, worker_s=self.wrk.seconds,
            content_s=self._content.seconds, idle_s=self._idle.seconds, cpu_s=cpu,
            manager_calls_s=dict(sorted(self.mgr.by_call.items(), key=lambda kv: -kv[1])),
        )

    def _idle_wait(self) -> None:
        """Nothing to compute: wait for our transfers, or give the tiers' threads time."""
        if self._jobs:
            self.wrk.wait(set(self._jobs))
        elif self.clock is not None:  # engine time: the step's clock jumps to the next tier landing
            self.c["idle_waits"] += 1
        else:  # only the tiers are busy (promotions): let their threads run
            with self._idle:
                time.sleep(self.opts.idle_sleep_s)
            self.c["idle_waits"] += 1

    def _drain_tiers(self, timeout_s: float = 60.0) -> None:
        """Keep stepping while the manager has work of its own (cascading
        stores to lower tiers), as an engine does, so the stats are final."""
        deadline = time.perf_counter() + timeout_s
        while self.manager.has_pending_work() and time.perf_counter() < deadline:
            self.mgr.on_schedule_end(ScheduleEndContext((), ()))
            with self._idle:
                time.sleep(self.opts.idle_sleep_s)

    def close(self) -> None:
        self.worker.shutdown()
        self.manager.shutdown()

    # ---- block contents -----------------------------------------------------

    def _compute(self, run: Running, upto: int | None = None) -> None:
        """The prefill: write the contents of every block not loaded (and of
        loaded ones that failed); the blocks become GPU prefix-cache entries.
        A chunked prefill (vllm order) calls it per chunk: the contents are
        written at the first, the blocks up to `upto` registered at each."""
        if not run.filled:
            run.filled = True
            self._fill(run)
        lo = max(run.registered, run.n_gpu)
        with self._content:
            self.gpu.register(run.slots[lo:upto], run.hashes[lo:upto])
        run.registered = len(run.slots) if upto is None else upto

    def _fill(self, run: Running) -> None:
        """Write the contents of every block the request computes."""
        first_new = run.n_gpu + run.n_off
        if run.bad:  # loads that failed are recomputed like any miss
            c = self.c
            redo = sorted(set(run.bad))
            tok = self.trace.block_tokens
            lost = sum(tok(run.req, i) for i in redo)
            c["offload_hit_tokens"] -= lost
            c["offload_hit_blocks"] -= len(redo)
            c["offload_hit_blocks_promoted"] -= len(run.promoted.intersection(redo))
            c["recomputed_tokens"] += lost
            sel = np.concatenate((np.array(redo, dtype=np.int64), np.arange(first_new, len(run.slots))))
        else:
            sel = slice(first_new, None)
        with self._content:
            self.contents.fill(run.slots[sel], run.seeds[sel])

    def _sample(self, done: int) -> None:
        self._collect_stats()
        c = self.c
        point = {"requests": done, "block_refs": c["block_refs"], "gpu_hit_blocks": c["gpu_hit_blocks"],
                 "offload_hit_blocks": c["offload_hit_blocks"],
                 "offload_hit_blocks_after_pending": c["offload_hit_blocks_after_pending"],
                 "offload_hit_blocks_promoted": c["offload_hit_blocks_promoted"]}
        self.timeline.append(point)


def _progress(total: int, opts: EngineOptions, name: str):
    if not opts.progress:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    desc = f"replay {name} {opts.progress_label}".rstrip()
    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, mininterval=0.5,
                position=opts.progress_position)


def replay(trace: Trace, opts: EngineOptions) -> ReplayResult:
    engine = ReplayEngine(trace, opts)
    try:
        return engine.run()
    finally:
        engine.close()
