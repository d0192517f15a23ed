"""The replay's simulated GPU prefix cache (replay/gpu.py)."""

from kvoffload.replay.engine import EngineOptions, replay
from kvoffload.replay.gpu import GPUBlocks
from kvoffload.replay.traces import Request, Trace


def _cached(gpu: GPUBlocks, hashes: list[int]) -> list[int]:
    """Compute blocks for hashes, then finish: they stay idle in the cache."""
    slots = gpu.allocate(len(hashes))
    gpu.register(slots, hashes)
    gpu.release(slots)
    return slots.tolist()


def test_a_request_never_evicts_its_own_gpu_hits():
    # 3 slots: hash 7 idle in the cache, 2 free; a request hitting 7 needs 2 fresh
    gpu = GPUBlocks(3, 8, cache_blocks=3)
    (s7,) = _cached(gpu, [7])
    assert gpu.can_allocate(2, [7])
    hit = gpu.acquire([7])
    fresh = gpu.allocate(2)
    assert hit == [s7] and sorted(fresh.tolist() + hit) == [0, 1, 2] and gpu.slot_of == {7: s7}


def test_no_room_once_hits_are_taken_changes_nothing():
    gpu = GPUBlocks(3, 8, cache_blocks=3)
    _cached(gpu, [7, 8, 9])
    # 3 idle blocks: 3 fresh ones fit for a request without hits, not for one hitting 7
    assert gpu.can_allocate(3, []) and not gpu.can_allocate(3, [7])
    assert gpu.allocate(4) is None
    assert list(gpu.idle) == [7, 8, 9] and gpu.evictions == 0 and gpu.num_free == 0


def test_abort_every_request_with_idle_gpu_hits():
    # found by hypothesis (test_properties): an idle GPU hit was evicted for the same
    # request's fresh blocks and then looked up (KeyError)
    hashes = [[0]] * 4 + [[1, 10], [0, 11], [1]] + [[0]] * 14
    outputs = [1, 1, 1, 1, 4, 8, 12] + [1] * 14
    trace = Trace("t", 4, [Request(str(i), float(i), 4 * len(h), outputs[i], h) for i, h in enumerate(hashes)])
    r = replay(trace, EngineOptions(extra_config={"num_cpu_chunks": 1}, progress=False, order="vllm",
                                    gpu_blocks=3, max_running=1, abort_every=1))
    c = r.counters
    assert c["requests"] == len(hashes) and c["verify_failures"] == 0
    assert c["gpu_hit_tokens"] + c["offload_hit_tokens"] + c["recomputed_tokens"] == c["prompt_tokens"]
