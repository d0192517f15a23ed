"""Clients of a running server, none of them ours where it matters: vLLM's
`vllm bench serve` (through `kvoffload vllm bench serve`) and
kv-cache-tester's trace_replay_tester.py; plus the output check, which asks
for tokens at temperature 0 one request at a time, each with the same prefix
length cached. Both matter on CPU with a random-weight model: under
concurrency the batch composition alone changes greedy tokens, and so does
computing a prefix afresh instead of reading it from a cache (vLLM's own or
the connector's: those two agree).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from serve_server import vllm_cli

# kv-cache-tester beside the repository (../shared/clients), as the project's docs place it
TRACE_TESTER = Path(__file__).resolve().parents[1].parent / "shared" / "clients" / "kv-cache-tester" / \
    "trace_replay_tester.py"


@dataclass
class Dataset:
    """A `vllm bench serve` dataset: its name in the table and its arguments."""
    name: str
    args: list[str]
    num_prompts: int
    concurrency: int


def prefix_dataset(num_prompts: int, prefix_len: int, suffix_len: int, num_prefixes: int, output_len: int,
                   concurrency: int) -> Dataset:
    return Dataset("shared-prefix", [
        "--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(prefix_len),
        "--prefix-repetition-suffix-len", str(suffix_len), "--prefix-repetition-num-prefixes", str(num_prefixes),
        "--prefix-repetition-output-len", str(output_len)], num_prompts, concurrency)


def random_dataset(num_prompts: int, input_len: int, output_len: int, concurrency: int) -> Dataset:
    return Dataset("no-reuse", [
        "--dataset-name", "random", "--random-input-len", str(input_len), "--random-output-len", str(output_len),
        "--random-range-ratio", "0"], num_prompts, concurrency)


def bench_args(ds: Dataset, model: str, seed: int) -> list[str]:
    return ["--backend", "vllm", "--model", model, "--tokenizer", model, *ds.args,
            "--num-prompts", str(ds.num_prompts), "--seed", str(seed)]


def pool(runs: list[dict]) -> dict:
    """`vllm bench serve` results of one workload (each seed its own prompts),
    pooled: TTFT percentiles over every request, throughput = requests / summed
    durations, and each repeat's throughput."""
    ttfts = sorted(t * 1000 for r in runs for t, err in zip(r["ttfts"], r["errors"]) if not err)

    def pct(q: float) -> float:
        return ttfts[min(len(ttfts) - 1, round(q * (len(ttfts) - 1)))] if ttfts else float("nan")

    completed, duration = sum(r["completed"] for r in runs), sum(r["duration"] for r in runs)
    return {"p50_ttft_ms": pct(0.5), "p90_ttft_ms": pct(0.9), "p99_ttft_ms": pct(0.99),
            "request_throughput": completed / duration, "completed": completed,
            "failed": sum(r["failed"] for r in runs), "duration_s": duration,
            "repeat_throughputs": [r["request_throughput"] for r in runs]}


def bench_once(base_url: str, model: str, ds: Dataset, result_dir: Path, tag: str, seed: int,
               log_path: Path) -> dict:
    """One `vllm bench serve` run (--save-detailed: per-request TTFTs)."""
    result_dir.mkdir(parents=True, exist_ok=True)
    fname = f"{tag}.json"
    cmd = vllm_cli() + ["bench", "serve", "--base-url", base_url, *bench_args(ds, model, seed),
                        "--max-concurrency", str(ds.concurrency), "--temperature", "0", "--ignore-eos",
                        "--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,90,99",
                        "--save-result", "--save-detailed", "--result-dir", str(result_dir),
                        "--result-filename", fname]
    with open(log_path, "ab") as log:
        log.write(f"\n$ {' '.join(cmd)}\n".encode())
        log.flush()
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode
    path = result_dir / fname
    if rc != 0 or not path.exists():
        raise RuntimeError(f"vllm bench serve ({tag}) exited with {rc}; see {log_path}")
    return json.loads(path.read_text())


def check_prompts(model: str, count: int, prefix_len: int, suffix_len: int, seed: int
                  ) -> list[tuple[list[int], list[int], list[int]]]:
    """`count` (warm, probe, other probe) token-id prompts sharing a prefix of
    prefix_len tokens (a multiple of the block size) and differing from the
    first suffix token on, so a probe served after its warm-up (or after the
    other probe) hits exactly the prefix."""
    import random

    vocab = json.loads((Path(model) / "config.json").read_text()).get("vocab_size", 4096)
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(16, vocab - 16) for _ in range(n)]

    out = []
    for _ in range(count):
        prefix, warm, probe, other = ids(prefix_len), ids(suffix_len), ids(suffix_len), ids(suffix_len)
        probe[0], other[0] = warm[0] + 1, warm[0] + 2  # (below vocab: ids stop 16 short of it)
        out.append((prefix + warm, prefix + probe, prefix + other))
    return out


def _post(base_url: str, path: str, body: dict | None, timeout: float = 600) -> dict:
    req = urllib.request.Request(base_url + path, data=json.dumps(body or {}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"{}")


def greedy_tokens(base_url: str, model: str, prompts: list[list[int]], max_tokens: int) -> list[list[int] | None]:
    """Each prompt's output token ids at temperature 0, one request at a time
    (None where the request failed)."""
    out: list[list[int] | None] = []
    for p in prompts:
        body = {"model": model, "prompt": p, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
                "return_token_ids": True}
        try:
            out.append(list(_post(base_url, "/v1/completions", body)["choices"][0]["token_ids"]))
        except (OSError, KeyError, ValueError, IndexError):
            out.append(None)
    return out


def reset_gpu_cache(base_url: str, timeout_s: float = 120.0) -> None:
    """Empty vLLM's own prefix cache, not the connector's (the server runs with
    VLLM_SERVER_DEV_MODE=1). vLLM refuses while offload stores still hold
    blocks: retried until they completed."""
    deadline = time.monotonic() + timeout_s
    while not _post(base_url, "/reset_prefix_cache", None).get("success"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"vLLM refused to reset its prefix cache for {timeout_s:.0f} s")
        time.sleep(0.5)


def output_check(base_url: str, model: str, warms: list[list[int]], probes: list[list[int]], max_tokens: int,
                 warm: int, reset: bool) -> list[list[int] | None]:
    """The probes' greedy tokens, each served with its prefix cached: warm-ups
    first (unless the prefixes are already in a shared store), then, with
    `reset`, vLLM's own cache emptied so the prefix can only come from the
    connector. Without reset (no offloading) vLLM's own cache serves it: the
    same prefix length cached, so the same computation, on every server.
    `warm` rounds of warm-ups (a store_threshold of N stores a block on its
    Nth offer), vLLM's cache emptied between them so each round computes."""
    for i in range(warm):
        if i and reset:
            reset_gpu_cache(base_url)
        greedy_tokens(base_url, model, warms, 1)
    if reset:
        reset_gpu_cache(base_url)
    return greedy_tokens(base_url, model, probes, max_tokens)


def trace_replay(base_url: str, model: str, out_dir: Path, trace_dir: str, max_context: int, duration_s: int,
                 max_users: int, log_path: Path, tester: Path = TRACE_TESTER) -> dict:
    """kv-cache-tester's replay of agentic conversations (multi-turn, a warm
    prefix shared across users), bounded by --max-context and --test-duration;
    --recycle starts a new user on a trace when one stops (the conversations
    outgrow --max-context after a turn or two here). Its per-request CSV
    summarised here."""
    if not Path(tester).exists():
        raise RuntimeError(f"kv-cache-tester not found at {tester} (--trace-tester)")
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(tester), "--api-endpoint", base_url, "--trace-directory", trace_dir,
           "--output-dir", str(out_dir), "--max-context", str(max_context), "--tokenizer", model,
           "--test-duration", str(duration_s), "--start-users", str(max_users), "--max-users", str(max_users),
           "--max-ttft", "1000", "--seed", "1", "--temperature", "0", "--skip-graphs", "--no-color",
           "--chunk-size", "32", "--recycle"]
    t0 = time.monotonic()
    with open(log_path, "ab") as log:
        log.write(f"\n$ {' '.join(cmd)}\n".encode())
        log.flush()
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=dict(os.environ), timeout=duration_s + 900).returncode
    wall = time.monotonic() - t0
    return summarize_trace_output(out_dir, rc, wall)


def summarize_trace_output(out_dir: Path, rc: int, wall_s: float) -> dict:
    import csv
    import statistics

    rows = []
    for f in sorted(out_dir.rglob("detailed_results.csv")):
        with open(f, newline="") as fh:
            reader = csv.DictReader(fh)
            if reader.fieldnames and "ttft" in [c.lower() for c in reader.fieldnames]:
                rows += list(reader)
    if not rows:
        raise RuntimeError(f"trace_replay_tester exited with {rc} and wrote no per-request CSV under {out_dir}")
    col = {c.lower(): c for c in rows[0]}
    ok = [r for r in rows if str(r.get(col.get("success", ""), "True")).lower() in ("true", "1")]
    ttfts = sorted(float(r[col["ttft"]]) * 1000 for r in ok if r[col["ttft"]] not in ("", None))

    def pct(q):
        return ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))] if ttfts else float("nan")

    return {"p50_ttft_ms": statistics.median(ttfts) if ttfts else float("nan"), "p90_ttft_ms": pct(0.9),
            "p99_ttft_ms": pct(0.99), "completed": len(ok), "failed": len(rows) - len(ok),
            "request_throughput": len(ok) / wall_s, "duration_s": wall_s, "exit_code": rc}


