"""`kvoffload replay`: replay a serving trace through real offload tiers.

The parser and the run; the option checks are in cli_checks.py, what the
options turn into in cli_options.py."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvoffload.config import ConfigError, memory_available
from kvoffload.policies import DEFAULT_POLICY, policy_names
from kvoffload.redact import redact_text
from kvoffload.replay.cli_checks import (  # noqa: F401 - parse_capacity: the benchmarks' too
    MAX_SESSIONS,
    check_args,
    check_engine_memory,
    parse_capacity,
    policy_list,
    sweep_points,
    write_output,
)
from kvoffload.replay.cli_options import ENGINE_BATCHED_TOKENS, build_options, load, start_observability, stop_observability
from kvoffload.replay.engine_time import TIME_MODELS
from kvoffload.replay.models import DEFAULT_MODEL, MODEL_PRESETS, preset_table
from kvoffload.replay.sweep import default_workers, fit_workers, replay_once, run_sweep
from kvoffload.replay.trace_model import Trace
from kvoffload.replay.traces import FORMATS


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "replay",  # its line in `kvoffload --help`: kvoffload.cli.COMMANDS
        description="Replay a trace (or, with no trace, a seeded multi-turn chat workload) through a "
                    "simulated engine driving a real OffloadingSpec, with real byte copies checked "
                    "byte for byte.")
    t = p.add_argument_group("workload")
    t.add_argument("trace", nargs="?", help="JSONL trace, or an agentic trace (kv-cache-tester JSON) file or "
                   "directory; omit for the embedded chat workload")
    t.add_argument("--format", default="auto", choices=("auto",) + FORMATS)
    t.add_argument("--block-size", type=int, help="tokens per block (default: the format's: "
                   "mooncake 512, bailian 16, tokens 16, agentic 64, generated chat 64)")
    t.add_argument("--limit", type=int, help="replay only the first N requests")
    t.add_argument("--stagger", type=float, metavar="SECONDS",
                   help="agentic traces: seconds between the conversations' starts, in file-name order "
                        "(default 60); sets their interleaving, with --arrival asap too")
    t.add_argument("--seed", type=int, default=0, help="seed of the generated workload (default 0)")
    t.add_argument("--sessions", type=int, default=200,
                   help=f"chat sessions of the generated workload (default 200, at most {MAX_SESSIONS:,})")
    t.add_argument("--hint-final-turns", action="store_true",
                   help="send kv_retention=low with every request whose new blocks no later request reuses "
                        "(what an application that knows a session's last turn would send; uses the trace's future)")
    s = p.add_argument_group("tiers (passed to the spec's extra_config)")
    s.add_argument("--spec", help="spec name or module:Class (default: cpu; 'tiered' when a storage "
                   "or remote option is given)")
    s.add_argument("--cpu-blocks", help="CPU tier capacity in blocks, or a share of the trace's "
                   "unique blocks such as 5%% (default 10%% unless --cpu-bytes)")
    s.add_argument("--cpu-bytes", help="CPU tier size, e.g. 2GiB (cpu_bytes_to_use)")
    s.add_argument("--policy", default=DEFAULT_POLICY,
                   help=f"eviction policy: {DEFAULT_POLICY} (default), "
                        f"{', '.join(p for p in policy_names() if p != DEFAULT_POLICY)} or module:Class; several, "
                        "comma-separated (lru,arc,hubchain): each replayed at the same capacities, side by "
                        "side, the best named (which policy suits your trace)")
    s.add_argument("--storage-dir", help="storage tier directory (storage_dir; needs a spec with a "
                   "storage tier, e.g. tiered)")
    s.add_argument("--storage-bytes", help="storage tier size (storage_bytes)")
    s.add_argument("--storage-blocks", help="storage tier size in blocks, or a share of the trace's unique "
                   "blocks such as 25%% (sets storage_bytes: that many slots of one block each)")
    s.add_argument("--remote-url", help="remote tier URL, e.g. redis://127.0.0.1:6379, or "
                   "mooncake://MASTER_HOST:RPC_PORT for a Mooncake Store (remote_url)")
    s.add_argument("--offload-prompt-only", action=argparse.BooleanOptionalAction, default=None,
                   help="offload only prompt blocks (the spec's default: yes)")
    s.add_argument("--extra", action="append", default=[], metavar="KEY=VALUE",
                   help="any other extra_config key (VALUE parsed as JSON when it parses)")
    e = p.add_argument_group("engine")
    e.add_argument("--gpu-blocks", type=int, default=0,
                   help="GPU prefix cache size in blocks (0: the trace README's reference semantics)")
    e.add_argument("--max-running", type=int, default=1, help="requests in flight at once (default 1)")
    e.add_argument("--max-batched-tokens", type=int,
                   help="prompt tokens computed per step (vLLM's chunked prefill): a long prompt is stored a "
                        f"chunk a step, as vLLM stores it (default: {ENGINE_BATCHED_TOKENS}, `vllm serve`'s on an "
                        "H100, with --time-model engine and --order vllm; else 0: each prompt whole in one step)")
    e.add_argument("--model", choices=sorted(MODEL_PRESETS), metavar="PRESET",
                   help=f"a model on a GPU: its KV bytes per token, prefill and decode rates (default "
                        f"{DEFAULT_MODEL} for the time model; copies stay at 16 B/token unless --model is "
                        f"given): {preset_table()}")
    e.add_argument("--kv-bytes-per-token", type=int, help="KV bytes per token actually copied (default: "
                   "--model's, else 16: fast; the time model still moves the model's bytes)")
    e.add_argument("--time-model", choices=TIME_MODELS, default="auto",
                   help="engine: a step lasts its compute time (prefill and decode at the model's rates) and "
                        "the tiers below CPU move bytes at their bandwidth on that simulated clock "
                        "(deterministic); fast: no clock, the tiers as fast as this machine runs them; auto "
                        "(default): engine with a tier below CPU, else fast")
    e.add_argument("--decode-tokens-per-s", type=float,
                   help="decode throughput of the engine, output tokens/s (default: --model's)")
    e.add_argument("--tier-bandwidth", action="append", default=[], metavar="NAME=RATE",
                   help="time model: a tier's bandwidth, e.g. storage=2GB/s (default by kind: local storage "
                        "2 GB/s, remote 2.5 GB/s; 100 us per job)")
    e.add_argument("--arrival", choices=("asap", "trace"), default="asap",
                   help="asap (default): as fast as possible; trace: on the trace's timestamps (simulated clock)")
    e.add_argument("--time-compression", type=float, default=1.0, help="divide timestamps by this (default 1)")
    e.add_argument("--prefill-tokens-per-s", type=float,
                   help="prefill throughput of the engine, prompt tokens/s: the time model, the time-saved "
                        "estimate, --arrival trace's clock (default: --model's, 10000 for llama-8b-h100)")
    e.add_argument("--sync-tiers", action="store_true",
                   help="let the tiers finish cascading stores after each step, whatever they take "
                        "(--time-model fast)")
    e.add_argument("--strict", action="store_true", help="stop at the first byte mismatch")
    e.add_argument("--verify", choices=("sample", "all"), default="sample",
                   help="byte checks of every loaded block: sample (default): its first and last 8 bytes and "
                        "6 more words spread over it; all: every byte (slower at small blocks)")
    e.add_argument("--copy-thread", action="store_true",
                   help="CPU tier: copy on the worker's own thread, as an engine does (default: in the step "
                        "loop's thread at submit, same results without two thread hand-offs per job)")
    e.add_argument("--order", choices=("vllm", "legacy"), default="vllm",
                   help="manager call order: vllm (default): vLLM's scheduler and OffloadingConnector (a "
                        "request finishes before its stores land; no touch); legacy: stores land before "
                        "the request finishes (the trace README's semantics: equals the --oracle LRU)")
    for flag, what in (("--preempt-every", "preempt the newest decoding request every N steps"),
                       ("--abort-every", "abort every N-th request in the step it is scheduled"),
                       ("--reset-every", "reset the offload cache (vLLM's reset contract) every N steps")):
        e.add_argument(flag, type=int, default=0, metavar="N", help=f"--order vllm: {what} (default 0: never)")
    o = p.add_argument_group("output")
    o.add_argument("--oracle", action="store_true", help="also simulate LRU and Belady at the same capacity")
    o.add_argument("--sweep", help="comma-separated CPU capacities (blocks or N%%) to replay, in parallel "
                   "processes when there are cores to spare")
    o.add_argument("--sweep-workers", type=int, metavar="N",
                   help="processes for --sweep (default: one per capacity, at most one per usable core; "
                        "1: one after the other)")
    o.add_argument("--json", help="write results as JSON here")
    o.add_argument("--markdown", help="write results as Markdown here")
    o.add_argument("--plot-dir", help="write PNG plots here")
    o.add_argument("--no-progress", action="store_true")
    o.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port while "
                   "replaying (0: any free port; watch it live with `kvoffload stats 127.0.0.1:PORT`)")
    o.add_argument("--no-vllm-metric-names", action="store_true",
                   help="only kvoffload_* series (default: also vLLM's own names for what we share)")
    o.add_argument("--events-endpoint", help="publish KV events (vLLM's ZMQ/msgpack format) on this "
                   "endpoint, e.g. tcp://127.0.0.1:5557")
    o.add_argument("--events-format", choices=("auto", "map", "array"), default="auto",
                   help="encoding of each event: vLLM's tagged maps (0.32+) or its earlier positional "
                        "arrays (default auto: the installed vLLM's, maps without vLLM)")
    o.add_argument("--hold", type=float, default=0.0,
                   help="keep the metrics endpoint up this many seconds after the replay")
    p.set_defaults(func=run)  # errors one line: kvoffload.cli.one_line_errors
    return p


def one_line(e: BaseException) -> str:
    """An error as one line, passwords in URLs masked."""
    if isinstance(e, OSError) and e.strerror:
        msg = f"{e.filename}: {e.strerror}" if e.filename else e.strerror
    else:
        msg = str(e) or type(e).__name__
    return redact_text(" ".join(msg.split()))

def _replays(args, trace: Trace, policies: list[str]) -> dict[str, list]:
    """Several replays of one command: each policy at each capacity (the
    --sweep's, else the one asked for), in parallel processes as the cores
    and the memory allow: {policy: [(capacity, result), ...]}. The oracles
    do not depend on the policy: only the first policy's replays simulate them."""
    from kvoffload.replay import report

    caps = sweep_points(args.sweep) if args.sweep else [None]
    runs = [(p, c) for p in policies for c in caps]
    several = len(policies) > 1
    options, labels = [], []
    for p, c in runs:
        o = build_options(args, trace, cpu_blocks=c, policy=p,
                          point=f"{p}, cpu {c or 'as asked'}" if several else f"cpu {c}")
        labels.append(f"[{p} {_capacity(o)}]" if several else f"[{c}]")
        o.progress_label = labels[-1]
        options.append(o)
    sizes = [check_engine_memory(trace, o) for o in options]

    def done(i: int, r) -> None:
        print(f"{labels[i]} offload prefix hit rate {report.summary(r)['offload_prefix_hit_rate']:.4f}",
              file=sys.stderr)

    # as many at once as the memory holds, the biggest together
    workers = fit_workers(sizes, args.sweep_workers or default_workers(len(options)), memory_available())
    oracles = [args.oracle and i < len(caps) for i in range(len(runs))]
    results = run_sweep(trace, options, oracles, workers, done)
    by_policy: dict[str, list] = {p: [] for p in policies}
    for (p, _), o, r in zip(runs, options, results):
        by_policy[p].append((_capacity(o, r), r))
    return by_policy


def _capacity(opts, result=None) -> int | str:
    """The CPU tier's capacity in blocks: as asked, or (--cpu-bytes) as the
    replay's first tier had it; before the replay, the bytes asked for."""
    extra = opts.extra_config
    if "num_cpu_chunks" in extra:
        return extra["num_cpu_chunks"]
    if result is not None and result.tiers:
        from kvoffload.replay import report

        first = next(iter(report.tier_rows(result).values()))
        if first.get("capacity_blocks"):
            return first["capacity_blocks"]
    return f"{extra['cpu_bytes_to_use']} bytes"


def run(args) -> int:
    """Every bad input, from an option to a trace line or an output path,
    ends here as one line and exit code 2."""
    try:
        return _run(args)
    except (ValueError, OSError) as e:  # ConfigError and TraceError are ValueErrors
        print(f"kvoffload replay: {one_line(e)}", file=sys.stderr)
        return 2


def _run(args) -> int:
    from kvoffload.replay import report

    check_args(args)
    try:
        start_observability(args)
        trace = load(args)
        policies = policy_list(args.policy)
        if len(policies) > 1:
            by_policy = _replays(args, trace, policies)
            results = [r for points in by_policy.values() for _, r in points]
            points = []
            print(report.policy_table(by_policy))
        elif args.sweep:
            points = _replays(args, trace, policies)[policies[0]]
            results = [r for _, r in points]
            print(report.sweep_table(points))
        else:
            opts = build_options(args, trace)
            check_engine_memory(trace, opts)
            results = [replay_once(trace, opts, args.oracle)]
            points = []
            print(report.format_table(results[0]))
    finally:
        stop_observability(args)
    compared = len(policies) > 1
    if args.json:
        several = points or compared
        write_output("--json", args.json, lambda: report.write_json(
            [report.to_json(r) for r in results] if several else report.to_json(results[0]), args.json))
    if args.markdown:
        if compared:
            md = report.policy_table(by_policy)
        else:
            md = report.sweep_table(points) if points else report.to_markdown(results[0])
        out = Path(args.markdown)
        # a trace name from a non-UTF-8 file name holds surrogates: write them as \udcXX
        write_output("--markdown", out, lambda: (out.parent.mkdir(parents=True, exist_ok=True),
                                                 out.write_text(md, encoding="utf-8", errors="backslashreplace")))
    if args.plot_dir:
        d = Path(args.plot_dir)
        d.mkdir(parents=True, exist_ok=True)
        if compared:
            report.plot_policies(by_policy, d / "hit_rate_by_policy.png", title=trace.name)
        else:
            report.plot_timeline(results[-1], d / "hit_rate_over_time.png")
        if points:
            report.plot_sweep(points, d / "hit_rate_vs_capacity.png", title=trace.name)
        print(f"plots written to {d}/", file=sys.stderr)
    for warning in dict.fromkeys(filter(None, map(report.cpu_size_warning, results))):
        print(f"kvoffload replay: warning: {warning}", file=sys.stderr)
    failures = sum(r.counters["verify_failures"] for r in results)
    if failures:
        print(f"kvoffload replay: {int(failures)} loaded blocks did not match what was stored",
              file=sys.stderr)
        return 1
    return 0
