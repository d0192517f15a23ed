"""The replay engine in vLLM's call order (--order vllm), with the real cpu
and tiered specs: the calls each step makes, in order; finishing before the
stores land; preemption, aborts and resets; and what is left at the end."""

from collections import defaultdict

import pytest

from kvoffload.abstractions import LookupResult, ReqContext
from kvoffload.replay.engine import EngineOptions, ReplayEngine
from kvoffload.replay.generator import generate_chat

# Within one step vLLM calls the manager in this order: schedule() (lookups,
# prepare_load), build_connector_meta() (on_schedule_end, prepare_store, then
# on_request_finished), update_connector_output() (complete_*).
RANK = {"on_new_request": 0, "lookup": 0, "prepare_load": 0, "on_schedule_end": 1, "prepare_store": 2,
        "on_request_finished": 3, "complete_load": 4, "complete_store": 4}
RECORDED = (*RANK, "touch", "reset_cache", "on_reset_flushed")


def _engine(tmp_path=None, spec="cpu", cap=120, **kw):
    extra = {"num_cpu_chunks": cap, "offload_prompt_only": False}
    if spec == "tiered":
        extra.update(storage_dir=str(tmp_path / "kv"), storage_bytes="4MiB")
    trace = generate_chat(seed=11, sessions=30, block_size=32)
    opts = EngineOptions(spec=spec, extra_config=extra, progress=False, max_running=4, gpu_blocks=16, **kw)
    return ReplayEngine(trace, opts)


def _record(engine):
    """Every manager call as (seq, step, name, req_id, keys)."""
    calls = []
    m = engine.manager
    for name in RECORDED:
        f = getattr(m, name, None)
        if f is None:
            continue

        def spy(*a, _f=f, _name=name, **k):
            ctx = next((x for x in (*a, *k.values()) if isinstance(x, ReqContext)), None)
            keys = a[0] if a and isinstance(a[0], (list, set, tuple, bytes)) else ()
            keys = [keys] if isinstance(keys, bytes) else list(keys)
            calls.append((len(calls), int(engine.c["steps"]), _name, ctx.req_id if ctx else None, keys))
            return _f(*a, **k)

        setattr(m, name, spy)
    return calls


def _run(engine):
    calls = _record(engine)
    try:
        result = engine.run()
        calls = list(calls)  # not the probes below
        cpu = engine.manager.primary if hasattr(engine.manager, "primary") else engine.manager
        gauges = cpu.get_stats().gauges
        stuck = [k for k in {k for *_, n, _, ks in calls if n == "lookup" for k in ks}
                 if engine.manager.lookup(k, ReqContext("probe")) is LookupResult.HIT_PENDING]
    finally:
        engine.close()
    return result, calls, gauges, stuck


def _check_end(result, gauges, stuck):
    c = result.counters
    assert c["verify_failures"] == 0 and c["verified_blocks"] == c["offload_hit_blocks"] > 0
    assert c["gpu_hit_tokens"] + c["offload_hit_tokens"] + c["recomputed_tokens"] == c["prompt_tokens"]
    assert gauges["pinned_blocks"] == 0 and gauges["pending_blocks"] == 0
    assert gauges.get("fenced_blocks", 0) == 0  # slots a reset held back are free after on_reset_flushed
    assert not stuck, f"{len(stuck)} keys still answer HIT_PENDING after the run"


def _check_requests(calls):
    """One on_request_finished per request, no submit call for it after it."""
    finished = {}
    for seq, _, name, req, _ in calls:
        if name == "on_request_finished":
            assert req not in finished, f"request {req} finished twice"
            finished[req] = seq
        elif name in ("prepare_store", "prepare_load", "lookup") and req in finished:
            raise AssertionError(f"{name} for request {req} after its on_request_finished")
    return finished


@pytest.mark.parametrize("max_batched_tokens", [0, 96], ids=["whole-prompts", "chunked-prefill"])
def test_calls_follow_vllms_step_order(max_batched_tokens):
    result, calls, gauges, stuck = _run(_engine(max_batched_tokens=max_batched_tokens))
    _check_end(result, gauges, stuck)
    finished = _check_requests(calls)
    assert len(finished) == result.counters["requests"]
    assert not [c for c in calls if c[2] == "touch"], "vLLM's connector never calls touch"
    by_step = defaultdict(list)
    for _, step, name, _, _ in calls:
        if name in RANK:
            by_step[step].append(RANK[name])
    for step, ranks in by_step.items():
        assert ranks == sorted(ranks), f"step {step}: calls out of vLLM's order"
    # completions arrive in a later step than their submission, and a
    # request's on_request_finished comes before its last store lands
    prepared = {}
    late = 0
    for seq, step, name, req, keys in calls:
        if name in ("prepare_store", "prepare_load"):
            for k in keys:  # an offer of a key already in flight stores nothing
                prepared.setdefault((name[-4:], req, k), step)
        elif name in ("complete_store", "complete_load"):
            assert all(prepared.pop((name[-4:], req, k)) < step for k in keys)
            late += name == "complete_store" and finished[req] < seq
    assert late > 0, "no request finished before its stores landed"


@pytest.mark.parametrize("max_batched_tokens", [0, 96], ids=["whole-prompts", "chunked-prefill"])
def test_preemption_and_aborts(max_batched_tokens):
    result, calls, gauges, stuck = _run(_engine(preempt_every=3, abort_every=4, max_batched_tokens=max_batched_tokens))
    c = result.counters
    assert c["preemptions"] > 0 and c["aborts"] > 0
    _check_end(result, gauges, stuck)
    finished = _check_requests(calls)
    assert len(finished) == c["requests"]  # preempted requests finish once, later
    # an abort while loading: the load lands after on_request_finished
    loads_after = [req for seq, _, name, req, _ in calls if name == "complete_load" and finished[req] < seq]
    assert loads_after


@pytest.mark.parametrize("max_batched_tokens", [0, 96], ids=["whole-prompts", "chunked-prefill"])
@pytest.mark.parametrize("spec", ["cpu", "tiered"])
def test_resets_follow_vllms_contract(tmp_path, spec, max_batched_tokens):
    result, calls, gauges, stuck = _run(_engine(tmp_path, spec, reset_every=7, abort_every=5,
                                                max_batched_tokens=max_batched_tokens))
    c = result.counters
    assert c["resets"] > 0 and c["stale_completions"] > 0
    _check_end(result, gauges, stuck)
    _check_requests(calls)
    # a job in flight at a reset is never completed: every complete_* names
    # keys prepared after the last reset before it
    last_reset = -1
    prepared = {}
    for seq, _, name, _, keys in calls:
        if name == "reset_cache":
            last_reset = seq
        elif name in ("prepare_store", "prepare_load"):
            prepared.update(dict.fromkeys(keys, seq))
        elif name in ("complete_store", "complete_load"):
            assert all(prepared[k] > last_reset for k in keys), f"{name} of a job dropped by a reset"
    assert sum(name == "on_reset_flushed" for _, _, name, _, _ in calls) == c["resets"]


def test_bad_order_options_are_refused(mooncake_file):
    from kvoffload.config import ConfigError
    from kvoffload.replay.traces import load_trace

    tr = load_trace(mooncake_file([[1]]), block_size=4)
    for kw, match in (({"order": "fifo"}, "order must be"), ({"reset_every": -1}, "reset_every"),
                      ({"order": "legacy", "abort_every": 2}, "needs order 'vllm'"),
                      ({"max_batched_tokens": 3}, r"at least one block \(4 tokens\), got 3"),
                      ({"max_batched_tokens": -4}, "max_batched_tokens must be"),
                      ({"order": "legacy", "max_batched_tokens": 8}, "needs order 'vllm'")):
        with pytest.raises(ConfigError, match=match):
            ReplayEngine(tr, EngineOptions(extra_config={"num_cpu_chunks": 4}, progress=False, **kw))


def test_chunked_prefill_stores_a_prompt_a_chunk_a_step(mooncake_file):
    """vLLM computes a long prompt over several steps (its token budget) and
    its connector stores each step's blocks then: a prompt longer than the
    CPU tier is stored as it goes, the tier evicting its own earlier chunks,
    where a whole-prompt step asks for more slots than the tier has and is
    refused (and offered again every step, never fitting)."""
    from kvoffload.replay.traces import load_trace

    tr = load_trace(mooncake_file([list(range(1, 11))], block_size=4), block_size=4)

    def run(max_batched_tokens):
        # LRU: it evicts the request's own earlier chunks (a prefix policy, the default, keeps them)
        engine = ReplayEngine(tr, EngineOptions(extra_config={"num_cpu_chunks": 6, "eviction_policy": "lru"},
                                                progress=False, max_batched_tokens=max_batched_tokens))
        result, calls, gauges, stuck = _run(engine)
        assert gauges["pinned_blocks"] == 0 and gauges["pending_blocks"] == 0 and not stuck
        stores = [(step, len(keys)) for _, step, name, _, keys in calls if name == "prepare_store"]
        return result.counters, stores

    c, stores = run(12)  # 3 blocks a step
    assert [n for _, n in stores[:4]] == [3, 3, 3, 1]
    assert [s for s, _ in stores[:4]] == sorted({s for s, _ in stores[:4]})  # one chunk a step
    assert c["allocation_failures"] == 0 and c["evicted_blocks"] == 4  # the tier keeps the last 6
    assert c["recomputed_tokens"] == 40  # every token once, chunked or not
    c, stores = run(0)
    assert stores[0][1] == 10 and c["allocation_failures"] >= 1 and c["evicted_blocks"] == 0


def test_sync_tiers_keeps_the_tiers_up_with_every_step(mooncake_file, tmp_path):
    """--sync-tiers stands for an engine whose compute covers the tiers'
    writes: they finish each step, not only between requests. A prompt of
    30 blocks, 3 a step, through a CPU tier of 8: every chunk reaches
    storage (drained only between requests, the cascades of earlier chunks
    still pinned CPU: 13 offers refused, 6 blocks never stored)."""
    from kvoffload.replay.engine import replay
    from kvoffload.replay.traces import load_trace

    prompt = list(range(1, 31))
    tr = load_trace(mooncake_file([prompt, prompt], block_size=4), block_size=4)
    r = replay(tr, EngineOptions(spec="tiered", progress=False, sync_tiers=True, max_batched_tokens=12,
                                 extra_config={"num_cpu_chunks": 8, "storage_dir": str(tmp_path / "kv"),
                                               "storage_bytes": "1MiB",
                                               # LRU: CPU evicts the prompt's own chunks as it goes
                                               "eviction_policy": "lru"}))
    assert r.counters["allocation_failures"] == 0
    assert r.tiers["storage"]["counters"]["stored_blocks"] == 30
    assert r.counters["offload_hit_blocks"] > 0 and r.counters["verify_failures"] == 0
