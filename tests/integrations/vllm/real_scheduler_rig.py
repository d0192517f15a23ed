"""vLLM's own Scheduler and OffloadingConnector driving our spec step by step
(no model: runner outputs made up, as vLLM's connector unit tests do), and
what the tests check after each step (test_real_scheduler.py)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvoffload.tiers.cpu.manager import PENDING
from tiny_model import VOCAB

GPU_BLOCK = 16  # tokens per GPU block
BLOCKS_PER_CHUNK = 2  # offloaded block = 2 GPU blocks
NUM_GPU_BLOCKS = 40  # small: requests preempt each other
WINDOW = 48  # tokens, the sliding-window group's
NUM_CPU_CHUNKS = 40  # small: stores evict


# ---- the engine: vLLM's scheduler and connectors, our spec --------------------------


class LateResults:
    """A worker of ours (the CPU tier's, or a secondary tier's) with each
    finished job reported 0-2 engine steps after it finished, except jobs
    waited for (wait(): a flush), reported at the next get_finished as
    vLLM's own test worker does. Every job submitted is waited for first,
    so the run does not depend on timing."""

    def __init__(self, inner, rng: random.Random, clock, late: tuple[int, int] = (0, 2)):
        self.inner, self.rng, self.clock, self.late = inner, rng, clock, late
        self.submitted: set[int] = set()
        self.held: list[tuple[int, object]] = []
        self.flushed: set[int] = set()

    def submit_store(self, job_id, src, dst):
        self.submitted.add(job_id)
        return self.inner.submit_store(job_id, src, dst)

    def submit_load(self, job_id, src, dst, *args, **kwargs):
        self.submitted.add(job_id)
        return self.inner.submit_load(job_id, src, dst, *args, **kwargs)

    def wait(self, job_ids):
        self.inner.wait(job_ids)
        self.flushed.update(job_ids)

    def get_finished(self):
        self.inner.wait(set(self.submitted))
        self.submitted.clear()
        now = self.clock()
        for r in sorted(self.inner.get_finished(), key=lambda r: r.job_id):
            assert r.success, f"our worker failed job {r.job_id}"
            self.held.append((now + self.rng.randint(*self.late), r))
        flushed, self.flushed = self.flushed, set()
        due = [r for s, r in self.held if s <= now or r.job_id in flushed]
        self.held = [(s, r) for s, r in self.held if s > now and r.job_id not in flushed]
        return due

    def __getattr__(self, name):  # anything else a worker has
        return getattr(self.inner, name)


def vllm_config(model_dir, extra: dict, async_scheduling: bool) -> VllmConfig:
    max_len = 1024
    return VllmConfig(
        model_config=ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float32",
                                 max_model_len=max_len, seed=0),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=128, max_model_len=max_len,
                                         enable_chunked_prefill=True, is_encoder_decoder=False,
                                         async_scheduling=async_scheduling),
        cache_config=CacheConfig(block_size=GPU_BLOCK, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both",
            kv_connector_extra_config={
                "spec_name": "KVOffloadingSpec", "spec_module_path": "kvoffload.integrations.vllm",
                "block_size": GPU_BLOCK * BLOCKS_PER_CHUNK, "num_cpu_chunks": NUM_CPU_CHUNKS, **extra}),
        device_config=DeviceConfig("cpu"),
    )


def kv_cache_config(hybrid: bool = True) -> KVCacheConfig:
    """A hybrid model: a full-attention group and a sliding-window group
    (hybrid=False: the full-attention group alone)."""
    kw = dict(block_size=GPU_BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float32)
    groups = [KVCacheGroupSpec(["layer0"], FullAttentionSpec(**kw))]
    if hybrid:
        groups.append(KVCacheGroupSpec(["layer1"], SlidingWindowSpec(**kw, sliding_window=WINDOW)))
    return KVCacheConfig(num_blocks=NUM_GPU_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)


class Engine:
    def __init__(self, model_dir, extra: dict, seed: int, async_scheduling: bool, hybrid: bool = True,
                 tier_late: tuple[int, int] = (0, 2)):
        self.rng = random.Random(seed)
        if extra.get("kvoffload_spec") == "tiered":  # promotions wait as long as they take, whatever the load
            extra = {"promotion_deadline_s": None, **extra}
        config = vllm_config(model_dir, extra, async_scheduling)
        kv_config = kv_cache_config(hybrid)
        config.cache_config.num_gpu_blocks = NUM_GPU_BLOCKS
        # The worker first: in one process the scheduler's manager pairs with
        # the worker already built (tiers below CPU read its host pool).
        self.worker = OffloadingConnector(config, KVConnectorRole.WORKER, kv_config)
        self.gpu = {name: torch.zeros(NUM_GPU_BLOCKS, g.kv_cache_spec.page_size_bytes, dtype=torch.int8)
                    for g in kv_config.kv_cache_groups for name in g.layer_names}
        self.worker.register_kv_caches(self.gpu)
        cw = self.worker.connector_worker
        cw.worker = LateResults(cw.worker, self.rng, lambda: self.steps)
        # Async (vLLM's default): a step's output is applied after the next step is scheduled.
        self.pending_output = None
        scheduler_cls = AsyncScheduler if async_scheduling else Scheduler
        self.scheduler = scheduler_cls(vllm_config=config, kv_cache_config=kv_config,
                                   structured_output_manager=StructuredOutputManager(config),
                                   block_size=GPU_BLOCK, log_stats=True)
        self.scheduler_config_async = async_scheduling
        self.connector = self.scheduler.connector.connector_scheduler  # vLLM's
        self.manager = self.connector.manager.inner  # ours
        for t in getattr(self.manager, "tiers", ()):  # the tiered spec's storage tier
            t.worker = LateResults(t.worker, self.rng, lambda: self.steps, tier_late)
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(GPU_BLOCK, sha256)
        self.steps = 0
        self.saw_loads = self.saw_full_cpu = self.saw_promotions = False
        self.preemptions = 0

    def add(self, req_id: str, prompt: list[int], max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        self.scheduler.add_request(Request(req_id, prompt, params, None, block_hasher=self.hasher))

    def step(self) -> None:
        so = self.scheduler.schedule()
        self.preemptions += len(so.preempted_req_ids or ())
        meta = so.kv_connector_metadata
        w = self.worker
        w.handle_preemptions(meta)
        w.bind_connector_metadata(meta)
        w.start_load_kv(None)
        w.wait_for_save()
        sending, recving = w.get_finished(so.finished_req_ids)
        worker_meta = w.build_connector_worker_meta()
        w.clear_connector_metadata()
        req_ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:  # a token for each request whose prompt is all computed now
            req = self.scheduler.requests[rid]
            sampled.append([self.rng.randrange(VOCAB)] if req.num_computed_tokens >= req.num_tokens else [])
        out = ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(finished_sending=sending or None,
                                                  finished_recving=recving or None,
                                                  kv_connector_worker_meta=worker_meta))
        if self.scheduler_config_async:
            self.flush()
            self.pending_output = (so, out)
        else:
            self.scheduler.update_from_output(so, out)
        self.steps += 1

    def flush(self) -> bool:
        """Apply a step's output still held (async); True if it left work."""
        if self.pending_output is not None:
            self.scheduler.update_from_output(*self.pending_output)
            self.pending_output = None
        return self.scheduler.has_requests()


# ---- what must agree --------------------------------------------------------------


def cpu_tier(manager):
    return getattr(manager, "primary", manager)


def slot_managers(manager):
    """Every manager of ours that holds keys: the CPU tier's and, if tiered, its tiers'."""
    yield cpu_tier(manager)
    for t in getattr(manager, "tiers", ()):
        yield t.manager


def pending_and_pinned(m) -> tuple[set[bytes], Counter]:
    """Keys being written, and pin counts, of a CPU or storage tier manager."""
    if hasattr(m, "_writing"):  # the storage tier's bookkeeping
        return set(m._writing), Counter({k: n for k, n in m._pins.items() if n > 0})
    pending, pinned = set(), Counter()
    for k, s in m._slot_of.items():
        v = m._state[s]
        if v == PENDING:
            pending.add(k)
        elif v > 0:
            pinned[k] = v
    return pending, pinned


def expected_cpu_slots(engine: Engine) -> tuple[set[bytes], Counter]:
    """CPU keys being written and pin counts that in-flight jobs account for:
    vLLM's (stores write CPU, loads read it) and the tiered manager's own
    (promotions write CPU, cascades read it)."""
    writes, reads = set(), Counter()
    for job in engine.connector._jobs.values():
        if job.is_store:
            writes.update(job.keys)
        else:
            reads.update(job.keys)
    for job in getattr(engine.manager, "jobs", ()):  # the tiered manager's JobTable
        if job.is_store:
            reads.update(job.keys)
        else:
            writes.update(job.keys)
            engine.saw_promotions = True
    for st in getattr(engine.manager, "_requests", {}).values():  # promoted, held until loaded
        reads.update(list(st.held))
        engine.saw_promotions |= bool(st.held)
    return writes, reads


def check_slots(engine: Engine, when: str) -> None:
    want_pending, want_pinned = expected_cpu_slots(engine)
    cpu = cpu_tier(engine.manager)
    pending, pinned = pending_and_pinned(cpu)
    engine.saw_loads |= any(not j.is_store for j in engine.connector._jobs.values())
    engine.saw_full_cpu |= not cpu._free
    if pending != want_pending:
        pytest.fail(f"{when}: CPU slots being written != keys of in-flight store jobs: "
                    f"{len(pending - want_pending)} pending with no job, "
                    f"{len(want_pending - pending)} in a job but not pending", pytrace=False)
    if pinned != want_pinned:
        pytest.fail(f"{when}: CPU pin counts != keys of in-flight load jobs: "
                    f"{sum((pinned - want_pinned).values())} pins with no job, "
                    f"{sum((want_pinned - pinned).values())} loads without a pin", pytrace=False)


# ---- stores vLLM never offers again ------------------------------------------------

# Counters of blocks a manager declines on purpose (the only stores allowed to be lost)
DECLINED = ("store_blocks_declined", "store_blocks_cut")


class StoreAudit:
    """Every answer our manager gives vLLM's connector to prepare_store. The
    connector moves past every block of an answered offer (an empty answer
    included), so an offered key that was not in CPU before the call and is
    not in keys_to_store is never offered again: lost, unless one of the
    DECLINED counters counts it. None is "offer again". The counters are
    summed from every get_stats() (vLLM's connector calls it and keeps none)."""

    def __init__(self, manager):
        self.cpu = cpu_tier(manager)
        self.lost = self.empty_answers = self.none_answers = 0
        self.counters: Counter = Counter()
        store, stats = manager.prepare_store, manager.get_stats

        def prepare_store(keys, ctx):
            keys = list(keys)
            new = [k for k in dict.fromkeys(keys) if k not in self.cpu]
            out = store(keys, ctx)
            if out is None:
                self.none_answers += 1
            elif new:
                stored = set(out.keys_to_store)
                self.lost += sum(k not in stored for k in new)
                self.empty_answers += not stored
            return out

        def get_stats():
            s = stats()
            self._add(s)
            return s

        manager.prepare_store, manager.get_stats = prepare_store, get_stats
        self.get_stats = get_stats

    def _add(self, s) -> None:
        for name, v in s.counters.items():
            self.counters[name] += v
        for c in s.children:
            self._add(c)

    def declined(self) -> int:
        self.get_stats()  # what the last steps counted
        return sum(self.counters[n] for n in DECLINED)
