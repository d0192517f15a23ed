"""Invariants of the replay on random small prefix-chained traces."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvoffload.replay.engine import EngineOptions, replay
from kvoffload.replay.oracle import simulate
from kvoffload.replay.traces import Request, Trace


@st.composite
def traces(draw):
    """Requests that extend earlier prompts (like chat turns) or start fresh
    from one of a few shared system-prompt blocks."""
    prompts: list[list[int]] = []
    next_id = 10
    for _ in range(draw(st.integers(1, 25))):
        if prompts and draw(st.booleans()):
            base = draw(st.sampled_from(prompts))
            base = base[: draw(st.integers(1, len(base)))]
        else:
            base = [draw(st.integers(0, 2))]
        extra = draw(st.integers(0, 5))
        prompts.append(base + list(range(next_id, next_id + extra)))
        next_id += extra
    reqs = [Request(str(i), float(i), len(p) * 4, 1, p) for i, p in enumerate(prompts)]
    return Trace("random", 4, reqs)


def _opts(cap, policy="lru", **kw):
    kw.setdefault("order", "legacy")  # the offline simulators follow the legacy order
    return EngineOptions(extra_config={"num_cpu_chunks": cap, "eviction_policy": policy}, progress=False, **kw)


SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(traces(), st.integers(1, 12))
def test_lru_replay_equals_offline_lru_and_never_beats_belady(trace, cap):
    blocks = [r.block_hashes for r in trace.requests]
    r = replay(trace, _opts(cap))
    assert r.counters["offload_hit_blocks"] == simulate(blocks, cap, "lru").prefix_hits
    best = simulate(blocks, cap, "belady").prefix_hits
    assert r.counters["offload_hit_blocks"] <= best
    assert replay(trace, _opts(cap, "arc")).counters["offload_hit_blocks"] <= best
    assert r.counters["verify_failures"] == 0


@SETTINGS
@given(traces(), st.integers(0, 8), st.integers(1, 3), st.sampled_from(["legacy", "vllm"]))
def test_every_prompt_token_is_accounted_once(trace, gpu_blocks, max_running, order):
    r = replay(trace, _opts(6, gpu_blocks=gpu_blocks, max_running=max_running, order=order))
    c = r.counters
    assert c["gpu_hit_tokens"] + c["offload_hit_tokens"] + c["recomputed_tokens"] == c["prompt_tokens"]
    assert c["gpu_hit_blocks"] + c["offload_hit_blocks"] <= c["block_refs"]
    assert c["verified_blocks"] == c["offload_hit_blocks"] and c["verify_failures"] == 0
    # with room for everything on the GPU, the offload tier is never needed
    big = replay(trace, _opts(6, gpu_blocks=10_000))
    infinite = simulate([q.block_hashes for q in trace.requests], 10_000, "lru").prefix_hits
    assert (big.counters["gpu_hit_blocks"], big.counters["offload_hit_blocks"]) == (infinite, 0)


@SETTINGS
@given(traces(), st.data(), st.integers(1, 8), st.integers(0, 6), st.integers(1, 3), st.booleans())
def test_vllm_order_with_preemption_aborts_and_resets_leaves_nothing_behind(
        trace, data, cap, gpu_blocks, max_running, prompt_only):
    # decode blocks, so requests run for several steps and can be preempted
    trace.requests = [Request(q.req_id, q.arrival_ms, q.prompt_tokens, data.draw(st.integers(1, 12)),
                              q.block_hashes) for q in trace.requests]
    every = {k: data.draw(st.integers(0, 5), label=k) for k in ("preempt_every", "abort_every", "reset_every")}
    r = replay(trace, EngineOptions(extra_config={"num_cpu_chunks": cap, "offload_prompt_only": prompt_only},
                                    progress=False, order="vllm", gpu_blocks=gpu_blocks,
                                    max_running=max_running, **every))
    c = r.counters
    assert c["requests"] == len(trace.requests)
    assert c["gpu_hit_tokens"] + c["offload_hit_tokens"] + c["recomputed_tokens"] == c["prompt_tokens"]
    assert c["verified_blocks"] == c["offload_hit_blocks"] and c["verify_failures"] == 0
    gauges = r.tiers["cpu"]["gauges"]
    assert gauges["pinned_blocks"] == 0 and gauges["pending_blocks"] == 0
