"""Offline generation with kvoffload under vLLM.

    python examples/vllm/offline.py --model <hf dir or id> --kv-config examples/vllm/cpu.json

Runs one long prompt twice with other prompts in between, and prints how many
prompt tokens vLLM got from the connector the second time.
"""

from __future__ import annotations

import argparse
import json
import os


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--kv-config", required=True, help="a kv-transfer-config JSON file")
    ap.add_argument("--gpu-blocks", type=int, default=None, help="cap vLLM's own KV cache (blocks)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="TP ranks (processes sharing one host pool on /dev/shm)")
    args = ap.parse_args()
    if args.tensor_parallel_size == 1:
        # at TP=1 the storage and remote tiers need vLLM's scheduler and worker in one process
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    with open(args.kv_config) as f:
        kv_config = KVTransferConfig(**json.load(f))
    llm = LLM(model=args.model, kv_transfer_config=kv_config, disable_log_stats=False,
              num_gpu_blocks_override=args.gpu_blocks, enable_prefix_caching=True,
              tensor_parallel_size=args.tensor_parallel_size)
    params = SamplingParams(temperature=0.0, max_tokens=16)
    prompt = {"prompt_token_ids": list(range(100, 100 + 2000))}
    others = [{"prompt_token_ids": list(range(i, i + 2000))} for i in (3000, 6000, 9000)]

    def external_hits() -> int:
        return sum(m.value for m in llm.get_metrics() if m.name == "vllm:external_prefix_cache_hits")

    first = llm.generate([prompt], params)[0].outputs[0].token_ids
    llm.generate(others, params)
    before = external_hits()
    again = llm.generate([prompt], params)[0].outputs[0].token_ids
    print(f"same output: {list(first) == list(again)}; prompt tokens from kvoffload: {external_hits() - before}")


if __name__ == "__main__":
    main()
