"""`kvoffload replay`'s option checks: every bad value refused before
anything runs, as one ConfigError naming the option and the value."""

from __future__ import annotations

import math
import os
from pathlib import Path
from urllib.parse import urlsplit

from kvoffload.config import ConfigError, check_fits_in_memory, parse_bytes, positive_int
from kvoffload.policies import get_policy_class
from kvoffload.redact import redact_url
from kvoffload.replay.trace_model import Trace

HOLD_MAX_S = 365 * 86400
# The generator draws every session's start time up front (8 bytes each), even under --limit.
MAX_SESSIONS = 10_000_000
# Options that are alternatives: given together, one would be silently ignored.
ALTERNATIVES = (("cpu_bytes", "cpu_blocks"), ("cpu_bytes", "sweep"), ("storage_bytes", "storage_blocks"))


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
    for name in ("trace", "cpu_blocks", "cpu_bytes", "storage_dir", "storage_bytes", "storage_blocks", "remote_url", "spec",
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
    finite("decode_tokens_per_s", args.decode_tokens_per_s, 0, False)
    if args.sync_tiers and args.time_model == "engine":
        raise ConfigError("--sync-tiers and --time-model engine are alternatives; give one")
    for item in args.tier_bandwidth:
        tier_rate(item)
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


def tier_rate(item: str) -> tuple[str, float]:
    """--tier-bandwidth NAME=RATE: (tier name, bytes per second); RATE a
    size per second such as 2GB/s, 500MiB/s or 2e9."""
    name, sep, rate = item.partition("=")
    if not sep or not name.strip() or not rate.strip():
        raise ConfigError(f"--tier-bandwidth {item!r}: expected NAME=RATE, e.g. storage=2GB/s")
    text = rate.strip().removesuffix("/s")
    try:
        value = float(text)
    except ValueError:
        try:
            value = float(parse_bytes(text, "--tier-bandwidth"))
        except (ConfigError, ValueError):
            raise ConfigError(f"--tier-bandwidth {item!r}: cannot parse the rate {rate!r} "
                              "(bytes per second, e.g. 2GB/s or 2e9)") from None
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"--tier-bandwidth {item!r}: the rate must be a finite number > 0")
    return name.strip(), value
