"""Run one vLLM engine over phases of prompts and print a JSON report.

Run as a script (vLLM may spawn workers, so the work sits under __main__):
    python engine_run.py '<json job>'
job: {"model": dir, "kv_transfer_config": {...} | null, "num_gpu_blocks": int,
      "phases": [[prompt token ids, ...], ...], "max_tokens": int,
      "tensor_parallel_size": int (1), "pool_dump": file (none),
      "pool_dump_after": phase index (the last)}
Each phase's prompts run one generate() call each, in order. The report has,
per phase: the generated tokens, seconds per prompt, and deltas of vLLM's
external prefix-cache hits and of kvoffload's per-tier counters. With
pool_dump, the host pool the ranks share (extra_config shared_pool_path) is
saved there (numpy, chunks x bytes) after the phases (or after phase
pool_dump_after).
"""

from __future__ import annotations

import json
import os
import sys
import time

REPORT_MARK = "KVOFFLOAD_REPORT "


def _metrics(llm) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        value = getattr(m, "value", None)
        if value is None:
            continue
        name = m.name
        if name.startswith("vllm:kvoffload_"):
            name = f"{name}[{m.labels.get('tier', '')}]"
        elif name.startswith("vllm:kv_offload_"):  # vLLM's own names (ours under them, or vLLM's)
            name = f"{name}[{m.labels.get('tier', m.labels.get('transfer_type', ''))}]"
        elif name not in ("vllm:external_prefix_cache_hits", "vllm:external_prefix_cache_queries",
                          "vllm:prefix_cache_hits", "vllm:prefix_cache_queries"):
            continue
        out[name] = out.get(name, 0) + value
    return out


def _dump_pool(job: dict) -> None:
    import numpy as np

    from kvoffload.tiers.host_pool import SharedHostPool

    path = job["kv_transfer_config"]["kv_connector_extra_config"]["shared_pool_path"]
    np.save(job["pool_dump"], SharedHostPool.open(path).array)


def main(job: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kwargs = dict(model=job["model"], skip_tokenizer_init=True, enforce_eager=True,
                  block_size=32, max_model_len=job.get("max_model_len", 512),
                  num_gpu_blocks_override=job["num_gpu_blocks"], disable_log_stats=False,
                  enable_prefix_caching=True, seed=0, gpu_memory_utilization=0.1, dtype=job.get("dtype", "bfloat16"),
                  tensor_parallel_size=job.get("tensor_parallel_size", 1))
    if job.get("kv_transfer_config"):
        kwargs["kv_transfer_config"] = KVTransferConfig(**job["kv_transfer_config"])
    llm = LLM(**kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)
    report = {"phases": []}
    before = _metrics(llm)
    dump_after = job.get("pool_dump_after", len(job["phases"]) - 1)
    for index, phase in enumerate(job["phases"]):
        tokens, seconds = [], []
        for prompt in phase:
            t0 = time.perf_counter()
            out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
            seconds.append(time.perf_counter() - t0)
            tokens.append(list(out.outputs[0].token_ids))
        after = _metrics(llm)
        delta = {k: v - before.get(k, 0) for k, v in after.items()}  # counters: this phase
        report["phases"].append({"tokens": tokens, "seconds": seconds, "metrics": delta})
        before = after
        if job.get("pool_dump") and index == dump_after:
            _dump_pool(job)
    llm.llm_engine.engine_core.shutdown()  # flushes tiers (persistent index) before exit
    return report


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: tiers need it
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; num_gpu_blocks_override caps it further
    result = main(json.loads(sys.argv[1]))
    print(REPORT_MARK + json.dumps(result), flush=True)
