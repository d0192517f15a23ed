"""kvoffload inside real `vllm serve` processes, driven by clients nobody here
wrote, every configuration against no offloading measured in the same run.

    python benchmarks/bench_serve.py                 # every configuration and dataset (~35 min on 2 cores)
    python benchmarks/bench_serve.py --quick         # a small smoke run (minutes)
    python benchmarks/bench_serve.py --configs none,cpu --datasets shared-prefix,no-reuse
    python benchmarks/bench_serve.py --model DIR     # a real model (a GPU box), instead of the demo one

Per configuration one server (`kvoffload vllm serve`, same core binding and
process layout for all), then:
  1. no-reuse: `vllm bench serve` on vLLM's random dataset (nothing shared);
  2. shared-prefix: `vllm bench serve` on vLLM's prefix_repetition dataset
     (num_prefixes shared prefixes, each with its own suffixes, shuffled);
  3. output check: --check-prompts prompts with a prefix of their own, one at a
     time at temperature 0, after a warm-up of each prefix and (offloading
     configurations) a reset of vLLM's own cache, so the prefix is served by
     the connector: their output token ids must equal the no-offload server's,
     where vLLM's own cache serves the same prefix (a prefix computed afresh
     gives other greedy tokens on CPU: not a fair reference);
  4. agentic: kv-cache-tester's trace_replay_tester.py on the agentic traces
     (multi-turn conversations; vLLM 0.32's `bench serve` has no multi-turn
     dataset), only for --trace-configs, its contexts capped by --trace-max-context.
vllm-all: no offloading, with vLLM's own cache big enough for every shared
prefix (phase 2 only): every reuse served from the engine's memory, nothing
moved, the most any offloading could give this workload on this machine.
shared-redis / shared-mooncake: after server A (cpu+redis / cpu+mooncake) ran
phase 2, a fresh server B over the same store runs the same prompts: its
TTFT, and its hits from /metrics, are what A computed.

Each phase reports TTFT p50/p90/p99, requests/s and failed requests, and the
offload hits (tokens served by the connector) and bytes from the server's
/metrics; every figure also as a ratio to `none` in this run. Results: JSON
(--out), a markdown table on stdout, a plot (--plot).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import serve_clients as clients  # noqa: E402
import serve_metrics as metrics  # noqa: E402
from serve_report import print_table, ratios, write_plot  # noqa: E402
from serve_server import ServeProcess, ServerOptions, parse_metrics  # noqa: E402
from serve_stores import (CONFIG_NAMES, OPTIONAL_CONFIGS, SHARED_WITH, STORE_THRESHOLD, Stores,  # noqa: E402
                          describe, kv_config)  # noqa: E402

DATASETS = ("shared-prefix", "no-reuse", "agentic")
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] if m['content'] is string "
                 "else m['content'] | map(attribute='text') | join('') }}\n{% endfor %}assistant:")
T0 = time.monotonic()


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.monotonic() - T0:5.0f}s] {msg}", flush=True)


def build_demo_model(path: Path, max_len: int) -> str:
    """The tiny random-weight Llama (4 layers, hidden 512) with its offline BPE tokenizer."""
    if not (path / "config.json").exists():
        subprocess.run([sys.executable, "-m", "kvoffload.cli", "vllm-demo-model", str(path), "--max-len",
                        str(max_len)], check=True, stdout=subprocess.DEVNULL)
    return str(path)


def kv_bytes_per_token(model: str) -> int:
    """KV cache bytes one token takes (all layers, K and V), from the model's config.json."""
    c = json.loads((Path(model) / "config.json").read_text())
    c = c.get("text_config", c)
    heads = c.get("num_key_value_heads") or c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    dtype = str(c.get("torch_dtype") or c.get("dtype") or "bfloat16")
    return c["num_hidden_layers"] * 2 * heads * head_dim * (4 if "32" in dtype else 2)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a model directory (default: build the demo model)")
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke run of minutes")
    ap.add_argument("--configs", default=",".join(CONFIG_NAMES),
                    help=f"of {', '.join(CONFIG_NAMES + OPTIONAL_CONFIGS)} "
                         f"(default: all but {', '.join(OPTIONAL_CONFIGS)})")
    ap.add_argument("--datasets", default=",".join(DATASETS), help=f"of {', '.join(DATASETS)}")
    ap.add_argument("--prompts", type=int, help="shared-prefix prompts (default 64; quick 24)")
    ap.add_argument("--prefix-len", type=int, help="tokens per shared prefix (default 2048; quick 512)")
    ap.add_argument("--suffix-len", type=int, help="tokens per suffix (default 512; quick 128)")
    ap.add_argument("--num-prefixes", type=int, help="shared prefixes (default 16; quick 8)")
    ap.add_argument("--output-len", type=int, default=16, help="output tokens per request")
    ap.add_argument("--random-prompts", type=int, help="no-reuse prompts (default 64; quick 8)")
    ap.add_argument("--random-input-len", type=int, help="no-reuse prompt tokens (default 2048; quick 512)")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--repeats", type=int, help="`vllm bench serve` runs per dataset and server, each with its own "
                    "seed (own prompts), pooled (default 3; quick 2)")
    ap.add_argument("--check-prompts", type=int, default=None, help="prompts in the output check (default 6; quick 4)")
    ap.add_argument("--gpu-blocks", type=int, help="vLLM's own cache, in blocks (default 384; quick 96)")
    ap.add_argument("--max-model-len", type=int, help="default: fits the longest prompt (and --trace-max-context)")
    ap.add_argument("--cpu-bytes", default="2GiB", help="CPU tier of cpu / cpu-lru")
    ap.add_argument("--tier-cpu-bytes", help="CPU tier in front of storage/redis/mooncake (default: half the "
                    "shared prefixes' KV, so the secondary tier serves part of the load)")
    ap.add_argument("--trace-configs", default="none,cpu", help="configurations that replay the agentic traces")
    ap.add_argument("--trace-dir", default=str(Path(__file__).resolve().parents[2] / "shared" / "traces" / "agentic"))
    ap.add_argument("--trace-tester", default=str(clients.TRACE_TESTER))
    ap.add_argument("--trace-max-context", type=int,
                    help="--max-context of the replay (default 12000; quick 11000: the traces start at 10.5k tokens)")
    ap.add_argument("--trace-duration", type=int, help="seconds of replay (default 100; quick 60)")
    ap.add_argument("--trace-users", type=int, default=2)
    ap.add_argument("--omp-bind", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND for every server")
    ap.add_argument("--uniproc", action="store_true",
                    help="VLLM_ENABLE_V1_MULTIPROCESSING=0 for every server (default: vLLM's own process layout)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-paired", dest="paired", action="store_false",
                    help="run the no-offload server once, first (default: kept up, its repeats interleaved with "
                         "each configuration's)")
    ap.add_argument("--work-dir", help="logs and results (default: a new temp dir)")
    ap.add_argument("--out", help="results JSON (default: WORK_DIR/results.json)")
    ap.add_argument("--plot", default="docs/img/serve_bench.png")
    a = ap.parse_args(argv)
    q = a.quick
    defaults = dict(prompts=(24, 64), prefix_len=(512, 2048), suffix_len=(128, 512), num_prefixes=(8, 16),
                    random_prompts=(8, 64), random_input_len=(512, 2048), check_prompts=(4, 6),
                    gpu_blocks=(96, 384), trace_max_context=(11000, 12000), trace_duration=(60, 100),
                    repeats=(2, 3))
    for key, (quick, full) in defaults.items():
        if getattr(a, key) is None:
            setattr(a, key, quick if q else full)
    a.configs = [c for c in a.configs.split(",") if c]
    a.datasets = [d for d in a.datasets.split(",") if d]
    for c in a.configs:
        if c not in CONFIG_NAMES + OPTIONAL_CONFIGS:
            ap.error(f"unknown configuration {c!r}; known: {', '.join(CONFIG_NAMES + OPTIONAL_CONFIGS)}")
    for d in a.datasets:
        if d not in DATASETS:
            ap.error(f"unknown dataset {d!r}; known: {', '.join(DATASETS)}")
    for b, server_a in SHARED_WITH.items():  # server B is served what server A stored
        if b in a.configs and server_a not in a.configs:
            a.configs.append(server_a)
    if "none" not in a.configs:
        a.configs.insert(0, "none")  # the reference every ratio is against
    a.configs.sort(key=lambda c: (c != "none", c in SHARED_WITH))  # none first, B servers after their A
    a.trace_configs = [c for c in a.trace_configs.split(",") if c in a.configs]
    longest = a.prefix_len + a.suffix_len + a.output_len + 64
    if "agentic" in a.datasets:
        longest = max(longest, a.trace_max_context + 1024)
    a.max_model_len = a.max_model_len or longest
    return a


class Bench:
    def __init__(self, a: argparse.Namespace, model: str, work: Path, stores: Stores):
        self.a, self.model, self.work, self.stores = a, model, work, stores
        gpu_blocks = max(a.gpu_blocks, a.max_model_len // 32 + 2)  # one request of max_model_len fits
        template = work / "chat_template.jinja"  # kv-cache-tester sends chat completions
        template.write_text(CHAT_TEMPLATE)
        self.opts = ServerOptions(model=model, gpu_blocks=gpu_blocks, max_model_len=a.max_model_len,
                                  omp_bind=a.omp_bind, uniproc=a.uniproc,
                                  extra_args=["--chat-template", str(template)])
        self.prefix = clients.prefix_dataset(a.prompts, a.prefix_len, a.suffix_len, a.num_prefixes, a.output_len,
                                             a.concurrency)
        self.random = clients.random_dataset(a.random_prompts, a.random_input_len, a.output_len, a.concurrency)
        check_prefix = min(a.prefix_len, 1024) // 32 * 32  # a whole number of blocks, cheap to prefill
        self.check_pairs = clients.check_prompts(model, a.check_prompts, check_prefix, 64, a.seed + 1) \
            if "shared-prefix" in a.datasets and a.check_prompts else []
        self.reference_tokens: dict[str, list] = {}  # probe set -> the no-offload server's answers
        self.fresh_tokens: dict[str, list] = {}
        self.ref: ServeProcess | None = None  # the no-offload server, kept up with --paired
        self.results: dict[str, dict] = {}

    def server(self, name: str) -> ServeProcess:
        cfg = kv_config(name, self.stores, self.a.cpu_bytes, self.a.tier_cpu_bytes)
        opts = self.opts
        if name == "vllm-all":  # every shared prefix, and the requests running beside them, twice over
            a = self.a
            tokens = a.num_prefixes * a.prefix_len + a.concurrency * (a.prefix_len + a.suffix_len + a.output_len)
            blocks = max(opts.gpu_blocks, 2 * tokens // 32)
            gib = -(-blocks * 32 * kv_bytes_per_token(self.model) // 2**30)  # vLLM-CPU's KV space must hold them
            opts = dataclasses.replace(opts, gpu_blocks=blocks, kvcache_space_gib=max(opts.kvcache_space_gib, gib))
        return ServeProcess(name.replace("+", "_"), opts, cfg, self.work)

    def phase(self, srv: ServeProcess, run) -> tuple[dict, dict]:
        before = parse_metrics(srv.metrics_text())
        out = run()
        return out, metrics.summary(before, parse_metrics(srv.metrics_text()))

    def run_config(self, name: str) -> None:
        a = self.a
        res = {"describe": describe(name, a.cpu_bytes, a.tier_cpu_bytes), "phases": {}}
        self.results[name] = res
        b_only = name in SHARED_WITH
        t = time.monotonic()
        srv = self.server(name).start()
        say(f"{name}: server up in {time.monotonic() - t:.0f} s ({res['describe']})")
        if name == "none" and a.paired:
            self.ref = srv
        try:
            self._run_phases(name, srv, b_only)
        finally:
            if srv is not self.ref:
                srv.stop()

    def _run_phases(self, name: str, srv: ServeProcess, b_only: bool) -> None:
        a, res = self.a, self.results[name]
        # no-reuse first: its blocks must not push server A's shared prefixes out of the store before B reads them
        if "no-reuse" in a.datasets and not b_only and name != "vllm-all":  # a bigger cache: nothing to see
            self.bench_phase(name, srv, self.random)
        if "shared-prefix" in a.datasets:
            self.bench_phase(name, srv, self.prefix)
            if self.check_pairs and name != "vllm-all":  # nothing offloaded to check
                self.check_phase(name, srv)
        if "agentic" in a.datasets and name in a.trace_configs:
            out, m = self.phase(srv, lambda: clients.trace_replay(
                srv.base_url, self.model, self.work / f"trace-{srv.name}", a.trace_dir, a.trace_max_context,
                a.trace_duration, a.trace_users, self.work / f"client-{srv.name}.log", Path(a.trace_tester)))
            res["phases"]["agentic"] = {**out, "metrics": m}
            say(f"{name}: agentic: {_line(out, m)}")

    def bench_phase(self, name: str, srv: ServeProcess, ds: clients.Dataset) -> None:
        """The dataset --repeats times, each with its own seed; with the no-offload
        server kept up (--paired), each repeat right after the same seed on it,
        so a drift in the machine's speed hits both sides of the ratio alike."""
        runs, refs = [], []
        results = self.work / "results"

        def run() -> None:
            for r in range(self.a.repeats):
                seed = self.a.seed + 1000 * r
                if self.ref is not None and self.ref is not srv:
                    refs.append(clients.bench_once(self.ref.base_url, self.model, ds, results,
                                                   f"none-for-{srv.name}-{ds.name}-s{seed}", seed,
                                                   self.work / "client-none.log"))
                runs.append(clients.bench_once(srv.base_url, self.model, ds, results, f"{srv.name}-{ds.name}-s{seed}",
                                               seed, self.work / f"client-{srv.name}.log"))

        _, m = self.phase(srv, run)
        out = clients.pool(runs)
        if refs:
            out["reference"] = clients.pool(refs)
        self.results[name]["phases"][ds.name] = {**out, "metrics": m}
        paired = f" | paired none: {out['reference']['request_throughput']:.3f} req/s" if refs else ""
        say(f"{name}: {ds.name}: {_line(out, m)}{paired}")

    def check_phase(self, name: str, srv: ServeProcess) -> None:
        """Greedy tokens of the check prompts with their prefixes cached (B servers:
        the other probes, so the cached length is the prefix's, not A's probe).
        The no-offload server answers both probe sets with the prefix cached by
        vLLM and with nothing cached (computed afresh): an answer equal to the
        latter is a recomputation (the connector missed), not wrong; an answer
        equal to neither is a mismatch."""
        warms = [w for w, _, _ in self.check_pairs]
        probe_sets = {"a": [p for _, p, _ in self.check_pairs], "b": [q for _, _, q in self.check_pairs]}
        if name == "none":
            for k, probes in probe_sets.items():
                clients.reset_gpu_cache(srv.base_url)
                self.fresh_tokens[k] = clients.greedy_tokens(srv.base_url, self.model, probes, self.a.output_len)
            clients.reset_gpu_cache(srv.base_url)
            self.reference_tokens["b"] = []  # filled below, after the warm-up, with the prefixes still cached
        which = "b" if name in SHARED_WITH else "a"
        # a B server's prefixes are in the store server A filled (A warmed them up in its own check)
        tokens, m = self.phase(srv, lambda: clients.output_check(
            srv.base_url, self.model, warms, probe_sets[which], self.a.output_len,
            warm=0 if name in SHARED_WITH else STORE_THRESHOLD.get(name, 1), reset=name != "none"))
        if name == "none":
            self.reference_tokens["a"] = tokens
            self.reference_tokens["b"] = clients.greedy_tokens(srv.base_url, self.model, probe_sets["b"],
                                                               self.a.output_len)
        ref = self.reference_tokens.get(which) or [None] * len(tokens)
        fresh = self.fresh_tokens.get(which) or [None] * len(tokens)
        failed = sum(t is None for t in tokens)
        recomputed = sum(1 for t, r, f in zip(tokens, ref, fresh) if t is not None and t != r and t == f)
        mismatches = sum(1 for t, r, f in zip(tokens, ref, fresh) if t is None or r is None or t not in (r, f))
        self.results[name]["check"] = {"prompts": len(tokens), "failed": failed, "mismatches": mismatches,
                                       "recomputed": recomputed, "offload_hit_tokens": m["offload_hit_tokens"],
                                       "vllm_cache_hit_tokens": m["vllm_cache_hit_tokens"]}
        say(f"{name}: output check: {len(tokens)} prompts, {mismatches} mismatches vs none, {recomputed} equal to "
            f"a recomputation (not served), {failed} failed, {m['offload_hit_tokens']:.0f} tokens served by the "
            f"connector")


def _line(out: dict, m: dict) -> str:
    return (f"TTFT p50 {out['p50_ttft_ms']:.0f} ms p90 {out['p90_ttft_ms']:.0f} p99 {out['p99_ttft_ms']:.0f}, "
            f"{out['request_throughput']:.3f} req/s"
            + (f" (repeats {min(out['repeat_throughputs']):.2f}-{max(out['repeat_throughputs']):.2f})"
               if out.get("repeat_throughputs") else "")
            + f", {out['completed']} ok {out['failed']} failed; "
            f"connector served {m['offload_hit_tokens']:.0f} tokens, loaded {m['loaded_bytes'] / 2**20:.0f} MiB, "
            f"stored {m['stored_bytes'] / 2**20:.0f} MiB; {metrics.tier_hits_line(m)}")


def machine() -> str:
    try:
        model = next(ln.split(":", 1)[1].strip() for ln in subprocess.run(
            ["lscpu"], capture_output=True, text=True).stdout.splitlines() if ln.startswith("Model name"))
    except (OSError, StopIteration):
        model = "unknown CPU"
    return f"{model}, {os.cpu_count()} cores"


def main(argv=None) -> int:
    a = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: servers and stores are stopped
    work = Path(a.work_dir or tempfile.mkdtemp(prefix="bench-serve-"))
    work.mkdir(parents=True, exist_ok=True)
    say(f"work dir {work}; configurations {', '.join(a.configs)}; datasets {', '.join(a.datasets)}"
        f"{' (--quick)' if a.quick else ''}")
    model = a.model or build_demo_model(work / "demo-model", max(8192, a.max_model_len))
    room = json.loads((Path(model) / "config.json").read_text()).get("max_position_embeddings")
    if room and room < a.max_model_len:
        sys.exit(f"bench_serve: {model} holds {room} positions, the run needs --max-model-len {a.max_model_len} "
                 "(lower --trace-max-context, or leave out agentic)")
    if a.tier_cpu_bytes is None:  # half the shared prefixes' KV
        a.tier_cpu_bytes = f"{max(8, a.num_prefixes * a.prefix_len * kv_bytes_per_token(model) // 2 // 2**20)}MiB"
    say(f"model {model} ({kv_bytes_per_token(model)} KV bytes per token)")
    stores = Stores(work)
    bench = Bench(a, model, work, stores)
    try:
        for name in a.configs:
            try:
                bench.run_config(name)
            except Exception as e:  # one configuration failing leaves the others' figures
                say(f"{name}: FAILED: {str(e).splitlines()[0] if str(e) else type(e).__name__} "
                    f"(traceback in {work / 'errors.log'})")
                with open(work / "errors.log", "a") as f:
                    traceback.print_exc(file=f)
                bench.results.setdefault(name, {})["error"] = str(e)[:2000] or type(e).__name__
    finally:
        if bench.ref is not None:
            bench.ref.stop()
        stores.close()
    report = {"machine": machine(), "quick": a.quick, "argv": sys.argv[1:], "args": {
        k: v for k, v in vars(a).items() if k not in ("configs", "datasets", "trace_configs")},
        "configs": a.configs, "results": bench.results, "ratios": ratios(bench.results)}
    out = Path(a.out or work / "results.json")
    out.write_text(json.dumps(report, indent=1))
    print_table(report)
    if a.plot:
        write_plot(report, Path(a.plot))
        say(f"plot {a.plot}")
    say(f"results {out}")
    bad = [n for n, r in bench.results.items() if "error" in r or r.get("check", {}).get("mismatches")
           or any(p.get("failed") for p in r.get("phases", {}).values())]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
