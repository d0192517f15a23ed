"""`kvoffload replay`'s options turned into what the engine runs: the trace
loaded, the spec's extra_config, the engine's options (model preset, time
model), and the run's metrics and event endpoints."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from kvoffload.config import ConfigError, check_fits_in_memory, parse_bytes
from kvoffload.replay.cli_checks import parse_capacity, policy_list, tier_rate
from kvoffload.replay.models import DEFAULT_MODEL, FAST_KV_BYTES_PER_TOKEN, MODEL_PRESETS, ModelPreset
from kvoffload.replay.trace_model import Trace
from kvoffload.replay.traces import load_trace, mark_final_turns

# vLLM's max_num_batched_tokens for `vllm serve` on a GPU of 70 GiB or more (an H100)
ENGINE_BATCHED_TOKENS = 8192
STORAGE_ALIGN = 4096  # the storage tier's slots: O_DIRECT-aligned chunks
# extra_config keys that put a tier below CPU
LOWER_TIER_KEYS = ("storage_dir", "remote_url", "secondary_tiers")


def preset(args) -> ModelPreset:
    return MODEL_PRESETS[args.model or DEFAULT_MODEL]


def batched_tokens(args, timing: str) -> int:
    """--max-batched-tokens, else the engine's chunked prefill under engine
    time (a step computes at most that many prompt tokens, as vLLM's does),
    else 0 (each prompt whole in one step: the fast mode's figures)."""
    if args.max_batched_tokens is not None:
        return args.max_batched_tokens
    return ENGINE_BATCHED_TOKENS if timing == "engine" and args.order == "vllm" else 0


def time_model(args, extra: dict[str, Any]) -> str:
    """--time-model auto: engine time when a tier below CPU is configured
    (unless --sync-tiers asks for the earlier wait-for-everything mode),
    else fast."""
    if args.time_model != "auto":
        return args.time_model
    lower = any(extra.get(k) for k in LOWER_TIER_KEYS)
    return "engine" if lower and not args.sync_tiers else "fast"


def extra_kv(items: list[str]) -> dict[str, Any]:
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


def load(args) -> Trace:
    trace = load_requests(args)
    if args.hint_final_turns:
        mark_final_turns(trace)
    return trace


def load_requests(args) -> Trace:
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
    given = extra_kv(args.extra)
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
    kv = args.kv_bytes_per_token or (preset(args).kv_bytes_per_token if args.model else FAST_KV_BYTES_PER_TOKEN)
    if args.storage_blocks:  # a storage slot holds one chunk (a block here), rounded up to 4 KiB
        slots = parse_capacity(args.storage_blocks, trace.num_unique_blocks(), "--storage-blocks")
        extra["storage_bytes"] = slots * (-(-kv * trace.block_size // STORAGE_ALIGN) * STORAGE_ALIGN)
    if args.remote_url:
        extra["remote_url"] = args.remote_url
    if args.offload_prompt_only is not None:
        extra["offload_prompt_only"] = args.offload_prompt_only
    extra.update(given)
    if point is not None and any(extra.get(k) for k in LOWER_TIER_KEYS):
        ns = extra.get("namespace", {})
        if isinstance(ns, dict):  # (else left as given: the spec names the error)
            extra["namespace"] = {**ns, "model": f"{ns.get('model', 'unknown')} (replay {point})"}
    spec = args.spec or ("tiered" if (args.storage_dir or args.remote_url) else "cpu")
    model = preset(args)
    timing = time_model(args, extra)
    return EngineOptions(
        spec=spec, extra_config=extra, kv_bytes_per_token=kv, gpu_blocks=args.gpu_blocks,
        max_running=args.max_running, max_batched_tokens=batched_tokens(args, timing), arrival=args.arrival,
        time_compression=args.time_compression,
        prefill_tokens_per_s=args.prefill_tokens_per_s or model.prefill_tokens_per_s,
        decode_tokens_per_s=args.decode_tokens_per_s or model.decode_tokens_per_s,
        model_kv_bytes_per_token=model.kv_bytes_per_token, time_model=timing,
        tier_bandwidth=dict(tier_rate(item) for item in args.tier_bandwidth) or None,
        strict=args.strict, verify=args.verify,
        sync_tiers=args.sync_tiers, copy_thread=args.copy_thread,
        progress=not args.no_progress, metrics=getattr(args, "_metrics", None),
        events=getattr(args, "_events", None), order=args.order, preempt_every=args.preempt_every,
        abort_every=args.abort_every, reset_every=args.reset_every,
    )


def start_observability(args) -> None:
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


def stop_observability(args) -> None:
    if getattr(args, "_metrics", None) is not None:
        if args.hold > 0:
            time.sleep(args.hold)
        args._metrics.close()
    if getattr(args, "_events", None) is not None:
        args._events.close()
