"""Run one vLLM engine over a list of generate() calls whose requests carry
their own kv_transfer_params, and print a JSON report (test_vllm_bad_requests.py).

    python bad_requests_run.py '<json job>'
job: {"model": dir, "kv_transfer_config": {...}, "num_gpu_blocks": int, "max_tokens": int,
      "calls": [[{"prompt": [token ids], "kv_transfer_params": any}, ...], ...]}
Each call is one generate() of its requests (a batch). The report has, per
call, the tokens of each request or the error generate() raised, and the
deltas of vLLM's prefix-cache and kvoffload metrics over the call. The
engine runs in vLLM's default layout: the engine core in its own process.
"""

from __future__ import annotations

import json
import os
import sys

from engine_run import REPORT_MARK, _metrics


def main(job: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    llm = LLM(model=job["model"], skip_tokenizer_init=True, enforce_eager=True, block_size=32,
              max_model_len=512, num_gpu_blocks_override=job["num_gpu_blocks"], disable_log_stats=False,
              enable_prefix_caching=True, seed=0, gpu_memory_utilization=0.1, dtype="bfloat16",
              kv_transfer_config=KVTransferConfig(**job["kv_transfer_config"]))
    calls = []
    before = _metrics(llm)
    for requests in job["calls"]:
        params = [SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True,
                                 extra_args={"kv_transfer_params": r["kv_transfer_params"]})
                  for r in requests]
        try:
            outs = llm.generate([{"prompt_token_ids": r["prompt"]} for r in requests], params, use_tqdm=False)
            call = {"tokens": [list(o.outputs[0].token_ids) for o in outs]}
        except Exception as e:  # noqa: BLE001 - the report says what killed the engine
            call = {"error": f"{type(e).__name__}: {e}"}
        try:
            after = _metrics(llm)
        except Exception:  # noqa: BLE001 - a dead engine has no metrics
            after = before
        call["metrics"] = {k: v - before.get(k, 0) for k, v in after.items()}
        before = after
        calls.append(call)
    llm.llm_engine.engine_core.shutdown()
    return {"calls": calls}


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    print(REPORT_MARK + json.dumps(main(json.loads(sys.argv[1]))), flush=True)
