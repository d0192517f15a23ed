"""`kvoffload replay`: replay a serving trace through real offload tiers."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kvoffload.config import ConfigError, check_fits_in_memory, memory_available, parse_bytes, positive_int
from kvoffload.policies import DEFAULT_POLICY, get_policy_class, policy_names
from kvoffload.redact import redact_text, redact_url
from kvoffload.replay.sweep import default_workers, fit_workers, replay_once, run_sweep
from kvoffload.replay.traces import FORMATS, Trace, load_trace, mark_final_turns

# KV bytes per token (K and V, all layers, bf16) of common models.
MODEL_PRESETS = {
    "tiny": 16,
    "llama-3.1-8b": 128 * 1024,  # 32 layers x 8 KV heads x 128 dims x 2 x 2 B
    "llama-3.1-70b": 320 * 1024,  # 80 layers x 8 x 128 x 2 x 2 B
    "mistral-7b": 128 * 1024,
    "qwen2.5-7b": 56 * 1024,  # 28 layers x 4 x 128 x 2 x 2 B
}


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
    e.add_argument("--max-batched-tokens", type=int, default=0,
                   help="prompt tokens computed per step (vLLM's chunked prefill; vLLM's default is 8192): a "
                        "long prompt is stored a chunk a step, as vLLM stores it (default 0: each prompt "
                        "whole in one step)")
    e.add_argument("--model", choices=sorted(MODEL_PRESETS), help="KV bytes per token of a model")
    e.add_argument("--kv-bytes-per-token", type=int, help="KV bytes per token (default 16: fast)")
    e.add_argument("--arrival", choices=("asap", "trace"), default="asap",
                   help="asap (default): as fast as possible; trace: on the trace's timestamps (simulated clock)")
    e.add_argument("--time-compression", type=float, default=1.0, help="divide timestamps by this (default 1)")
    e.add_argument("--prefill-tokens-per-s", type=float, default=10_000.0,
                   help="prefill cost, for the time-saved estimate and the simulated clock (default 10000)")
    e.add_argument("--sync-tiers", action="store_true",
                   help="let the tiers finish cascading stores after each step (deterministic)")
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


HOLD_MAX_S = 365 * 86400
# The generator draws every session's start time up front (8 bytes each), even under --limit.
MAX_SESSIONS = 10_000_000
# Options that are alternatives: given together, one would be silently ignored.
ALTERNATIVES = (("cpu_bytes", "cpu_blocks"), ("cpu_bytes", "sweep"), ("model", "kv_bytes_per_token"))


def option(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_args(args) -> None:
    """Refuse bad option values before anything runs (ConfigError naming
    the option and the value)."""
    def finite(name: str, value: float | None, low: float, low_ok: bool) -> None:
        if value is not None and not (math.isfinite(value) and (value >= low if low_ok else value > low)):
            need = f"a finite number {'>=' if low_ok else '>'} {low:g}"
            raise ConfigError(f"--{name.replace('_', '-')} must be {need}, got {value!r}")
    # '' is a mistake (an unset shell variable), not "the default": argparse passes it through
    for name in ("trace", "cpu_blocks", "cpu_bytes", "storage_dir", "storage_bytes", "remote_url", "spec",
                 "json", "markdown", "plot_dir", "events_endpoint"):
        value = getattr(args, name)
        if value is not None and not value.strip():
            what = "the trace path" if name == "trace" else option(name)
            raise ConfigError(f"{what} is empty ({value!r}); give a value or leave the option out")
    for a, b in ALTERNATIVES:
        if getattr(args, a) is not None and getattr(args, b) is not None:
            raise ConfigError(f"{option(a)} and {option(b)} are alternatives; give one")
    policies = policy_list(args.policy)
    if not policies:
        raise ConfigError(f"--policy {args.policy!r} names no policy (e.g. lru, or lru,arc,hubchain)")
    for name in policies:
        if policies.count(name) > 1:
            raise ConfigError(f"--policy names {name!r} twice")
        get_policy_class(name)  # an unknown one: ConfigError naming it and the known ones
    finite("hold", args.hold, 0, True)
    if args.hold > HOLD_MAX_S:  # time.sleep overflows past time_t
        raise ConfigError(f"--hold must be at most {HOLD_MAX_S} seconds (a year), got {args.hold!r}")
    finite("prefill_tokens_per_s", args.prefill_tokens_per_s, 0, False)
    finite("time_compression", args.time_compression, 0, False)
    finite("stagger", args.stagger, 0, True)
    for name in ("kv_bytes_per_token", "max_running", "sessions"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {value}")
    if args.sessions > MAX_SESSIONS:
        raise ConfigError(f"--sessions must be at most {MAX_SESSIONS}, got {args.sessions}")
    if args.seed < 0:
        raise ConfigError(f"--seed must be 0 or more, got {args.seed}")
    if args.gpu_blocks < 0:
        raise ConfigError(f"--gpu-blocks must be 0 or more, got {args.gpu_blocks}")
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        raise ConfigError(f"--metrics-port must be a TCP port in 0..65535 (0: any free one), got {args.metrics_port}")
    if args.sweep_workers is not None and args.sweep_workers <= 0:
        raise ConfigError(f"--sweep-workers must be positive, got {args.sweep_workers}")
    if args.sweep is not None and not sweep_points(args.sweep):
        raise ConfigError(f"--sweep {args.sweep!r} names no capacity (e.g. 1%,5%,1000)")
    if args.remote_url is not None:
        try:
            parts = urlsplit(args.remote_url)
            parts.port  # noqa: B018 - parses the port: ValueError when out of range
        except ValueError as e:
            raise ConfigError(f"--remote-url {redact_url(args.remote_url)!r}: {e}") from None
    for name in ("json", "markdown", "plot_dir"):
        if getattr(args, name) is not None:
            check_output(option(name), getattr(args, name), directory=name == "plot_dir")
    if args.json is not None and args.markdown is not None and \
            os.path.realpath(args.json) == os.path.realpath(args.markdown):
        raise ConfigError(f"--json and --markdown name the same file {args.markdown!r}; give two")


def check_output(flag: str, path: str, directory: bool = False) -> None:
    """Refuse now, not after an hour-long sweep, an output the end could not
    write: its folder (or the nearest that exists; the rest is made at the
    end) must be a writable directory, and an existing file writable."""
    p = Path(path)
    if p.is_dir() and not directory:
        raise ConfigError(f"{flag} {path!r} is a directory; give a file path")
    if p.exists() and not p.is_dir() and directory:
        raise ConfigError(f"{flag} {path!r} is not a directory")
    here = p if directory else p.parent
    while not here.exists() and here != here.parent:
        here = here.parent
    if not here.is_dir():
        raise ConfigError(f"{flag} {path!r}: {str(here)!r} is not a directory")
    if not os.access(here, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path!r}: {str(here)!r} is not writable")
    if p.is_file():  # a regular file only (a FIFO would block); root's access() passes /proc files
        try:
            open(p, "ab").close()  # appends nothing: the file is unchanged
        except OSError as e:
            raise ConfigError(f"{flag} {path!r}: {e.strerror}") from None


def write_output(flag: str, path: str | Path, write) -> None:
    """write(), its OSError naming the option and the file (ENOSPC and EIO name neither)."""
    try:
        write()
    except OSError as e:
        raise ConfigError(f"cannot write {flag} {str(path)!r}: {e.strerror or e}") from None


def sweep_points(value: str) -> list[str]:
    return [c.strip() for c in value.split(",") if c.strip()]


def policy_list(value: str) -> list[str]:
    return [p.strip() for p in value.split(",") if p.strip()]


def check_engine_memory(trace: Trace, opts) -> int:
    """The simulated GPU cache is allocated first, sized as ReplayEngine
    sizes it (room for every running request at its largest, plus the
    cache): refuse a size the machine cannot hold before allocating it.
    Returns about what the replay holds in memory (that cache and a CPU
    pool of num_cpu_chunks pages, 4 KiB-aligned, or cpu_bytes_to_use)."""
    bs = trace.block_size

    def blocks_of(r) -> int:
        decode = (len(r.decode_hashes) if r.decode_hashes is not None
                  else max(0, (r.prompt_tokens + r.output_tokens) // bs - len(r.block_hashes)))
        return len(r.block_hashes) + decode

    biggest = max(blocks_of(r) for r in trace.requests)
    blocks = opts.gpu_blocks + opts.max_running * max(1, biggest)
    page = opts.kv_bytes_per_token * bs
    check_fits_in_memory(blocks * page, f"the simulated GPU KV cache ({blocks} blocks of {page} bytes: "
                                        f"--gpu-blocks, --max-running, the longest request, --kv-bytes-per-token)")
    extra = opts.extra_config
    # --extra values are raw: read them by the spec's own rules (its ConfigError naming the key)
    if "cpu_bytes_to_use" in extra:
        pool = parse_bytes(extra["cpu_bytes_to_use"], "cpu_bytes_to_use")
    elif "num_cpu_chunks" in extra:
        pool = positive_int(extra["num_cpu_chunks"], "num_cpu_chunks") * (-(-page // 4096) * 4096)
    else:
        pool = 0
    return blocks * page + pool


def parse_capacity(value: str, unique_blocks: int, key: str = "--cpu-blocks") -> int:
    v = str(value).strip()
    try:
        if v.endswith("%"):
            share = float(v[:-1])
            if not math.isfinite(share):
                raise ValueError(v)
            n = int(share / 100.0 * unique_blocks + 0.5)
        else:
            n = int(v)
    except ValueError:
        raise ConfigError(f"{key}: cannot parse {value!r} (blocks, or a share such as 5%)") from None
    if n <= 0:
        raise ConfigError(f"{key}: {value!r} gives {n} blocks; need at least 1")
    return n


def _extra_kv(items: list[str]) -> dict[str, Any]:
    out = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--extra {item!r}: expected KEY=VALUE")
        k, v = item.split("=", 1)
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
        except RecursionError:
            raise ConfigError(f"--extra {k}: JSON nested too deeply") from None
        except ValueError as e:  # an integer of more than 4300 digits
            raise ConfigError(f"--extra {k}: {e}") from None
    return out


def _load(args) -> Trace:
    trace = _load_requests(args)
    if args.hint_final_turns:
        mark_final_turns(trace)
    return trace


def _load_requests(args) -> Trace:
    if args.trace:
        return load_trace(args.trace, args.format, args.block_size, args.limit, stagger_s=args.stagger)
    from kvoffload.replay.generator import generate_chat

    if args.sessions <= 0 or (args.block_size is not None and args.block_size <= 0):
        raise ConfigError("--sessions and --block-size must be positive")
    if args.limit is not None and args.limit <= 0:
        raise ConfigError(f"--limit must be positive, got {args.limit}")
    bs = 64 if args.block_size is None else args.block_size
    # --limit N needs only the first N sessions; each costs about 4 KiB plus its block
    # hashes (8-byte references, in every turn's prefix), and each start time 8 bytes
    built = min(args.sessions, args.limit or args.sessions)
    check_fits_in_memory(8 * args.sessions + built * (4096 + 400_000 // bs),
                         f"the generated workload ({built:,} sessions of --sessions {args.sessions:,} "
                         f"at --block-size {bs})")
    return generate_chat(seed=args.seed, sessions=args.sessions, block_size=bs, limit=args.limit,
                         progress=not args.no_progress)


def build_options(args, trace: Trace, cpu_blocks: str | None = None, policy: str | None = None,
                  point: str | None = None):
    """The engine's options for one replay. `point` names one replay of
    several (a --sweep's capacity, a --policy list's policy): the tiers
    below CPU keep their blocks under a namespace of their own for it, so
    replays running side by side neither share a storage directory (its
    lock) nor serve each other's blocks."""
    from kvoffload.replay.engine import EngineOptions

    extra: dict[str, Any] = {"eviction_policy": policy or policy_list(args.policy)[0]}
    given = _extra_kv(args.extra)
    cap = cpu_blocks or args.cpu_blocks
    if cap is not None or not (args.cpu_bytes or "cpu_bytes_to_use" in given):
        # name what the capacity came from: a trace with few unique blocks gives 10% of them = 0
        key = "--sweep" if cpu_blocks else "--cpu-blocks" if args.cpu_blocks else "--cpu-blocks (default 10%)"
        extra["num_cpu_chunks"] = parse_capacity(cap or "10%", trace.num_unique_blocks(), key)
    if args.cpu_bytes and not cpu_blocks:
        extra.pop("num_cpu_chunks", None)
        extra["cpu_bytes_to_use"] = parse_bytes(args.cpu_bytes, "--cpu-bytes")
    if args.storage_dir:
        extra["storage_dir"] = args.storage_dir
    if args.storage_bytes:
        extra["storage_bytes"] = parse_bytes(args.storage_bytes, "--storage-bytes")
    if args.remote_url:
        extra["remote_url"] = args.remote_url
    if args.offload_prompt_only is not None:
        extra["offload_prompt_only"] = args.offload_prompt_only
    extra.update(given)
    if point is not None and any(extra.get(k) for k in ("storage_dir", "remote_url", "secondary_tiers")):
        ns = extra.get("namespace", {})
        if isinstance(ns, dict):  # (else left as given: the spec names the error)
            extra["namespace"] = {**ns, "model": f"{ns.get('model', 'unknown')} (replay {point})"}
    spec = args.spec or ("tiered" if (args.storage_dir or args.remote_url) else "cpu")
    kv = args.kv_bytes_per_token or MODEL_PRESETS[args.model or "tiny"]
    return EngineOptions(
        spec=spec, extra_config=extra, kv_bytes_per_token=kv, gpu_blocks=args.gpu_blocks,
        max_running=args.max_running, max_batched_tokens=args.max_batched_tokens, arrival=args.arrival,
        time_compression=args.time_compression,
        prefill_tokens_per_s=args.prefill_tokens_per_s, strict=args.strict, verify=args.verify,
        sync_tiers=args.sync_tiers, copy_thread=args.copy_thread,
        progress=not args.no_progress, metrics=getattr(args, "_metrics", None),
        events=getattr(args, "_events", None), order=args.order, preempt_every=args.preempt_every,
        abort_every=args.abort_every, reset_every=args.reset_every,
    )


def _start_observability(args) -> None:
    """Metrics endpoint and event publisher, shared by every replay of this run."""
    args._metrics = args._events = None
    if args.metrics_port is not None:
        from kvoffload.metrics import PrometheusMetrics

        args._metrics = PrometheusMetrics(config_info={"policy": args.policy, "spec": args.spec or "auto"},
                                          vllm_names=not args.no_vllm_metric_names)
        try:
            port = args._metrics.serve(args.metrics_port)
        except OSError as e:  # "Address already in use" names no port
            raise ConfigError(f"--metrics-port {args.metrics_port}: {e.strerror or e}") from None
        print(f"kvoffload replay: metrics on http://127.0.0.1:{port}/metrics", file=sys.stderr)
    if args.events_endpoint:
        from kvoffload.events import ZmqEventPublisher

        args._events = ZmqEventPublisher(args.events_endpoint, event_format=args.events_format)
        print(f"kvoffload replay: KV events on {args._events.endpoint}", file=sys.stderr)


def _stop_observability(args) -> None:
    if getattr(args, "_metrics", None) is not None:
        if args.hold > 0:
            time.sleep(args.hold)
        args._metrics.close()
    if getattr(args, "_events", None) is not None:
        args._events.close()


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
        _start_observability(args)
        trace = _load(args)
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
        _stop_observability(args)
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
    failures = sum(r.counters["verify_failures"] for r in results)
    if failures:
        print(f"kvoffload replay: {int(failures)} loaded blocks did not match what was stored",
              file=sys.stderr)
        return 1
    return 0
