"""`kvoffload demo`: real KV bytes through the CPU tier, end to end.

A stand-in engine (random bytes in per-layer KV tensors) offloads two
requests into a host pool too small for both, so the first one's tail is
evicted; then both prefixes come back, are loaded into fresh GPU blocks
and compared bit for bit with what was stored.
"""

from __future__ import annotations

import hashlib
import sys

import torch

from kvoffload.abstractions import GPULoadStoreSpec, LookupResult, ReqContext
from kvoffload.config import OffloadingConfig, check_fits_in_memory
from kvoffload.keys import make_offload_key
from kvoffload.kv_caches import random_kv_caches
from kvoffload.policies import DEFAULT_POLICY, policy_names
from kvoffload.tiers.cpu.spec import CPUOffloadingSpec

TOKENS_PER_BLOCK = 16


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("demo")  # its help line: kvoffload.cli.COMMANDS
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--page-kib", type=int, default=32, help="KV bytes per layer per GPU block, KiB")
    p.add_argument("--chunks-per-request", type=int, default=8)
    p.add_argument("--cpu-chunks", type=int, default=12, help="host pool capacity, in chunks")
    p.add_argument("--policy", default=DEFAULT_POLICY,
                   help=f"eviction policy: {DEFAULT_POLICY} (default), "
                        f"{', '.join(p for p in policy_names() if p != DEFAULT_POLICY)} or module:Class")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)  # errors one line: kvoffload.cli.one_line_errors


def chunk_keys(prompt: str, n: int) -> list[bytes]:
    """Prefix-chained hashes, as an engine computes them from token ids."""
    keys, parent = [], b""
    for i in range(n):
        parent = hashlib.sha256(parent + f"{prompt}:{i}".encode()).digest()[:16]
        keys.append(make_offload_key(parent, 0))
    return keys


def run(args) -> int:
    try:
        return _run(args)
    except ValueError as e:  # ConfigError included: bad options
        print(f"kvoffload demo: {e}", file=sys.stderr)
        return 2


def _run(args) -> int:
    for name in ("layers", "page_kib", "chunks_per_request", "cpu_chunks"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if not 0 <= args.seed < 2**64:  # torch's seed range ("Overflow when unpacking long long" names nothing)
        raise ValueError(f"--seed must be in [0, 2**64), got {args.seed}")
    block_size = 2 * TOKENS_PER_BLOCK  # one chunk = 2 GPU blocks
    page = args.page_kib * 1024
    chunk_bytes = args.layers * 2 * page
    n = args.chunks_per_request
    num_blocks = 8 * n
    # the stand-in GPU KV caches and their copy (the CPU spec checks its own pool)
    check_fits_in_memory(2 * args.layers * num_blocks * page, f"the demo's KV caches ({args.layers} layers x "
                                                             f"{num_blocks} blocks x --page-kib {args.page_kib})")
    config = OffloadingConfig.from_dict({
        "groups": [{"tokens_per_block": TOKENS_PER_BLOCK}],
        "tokens_per_hash": TOKENS_PER_BLOCK,
        "extra_config": {
            "cpu_bytes_to_use": args.cpu_chunks * chunk_bytes,
            "kv_bytes_per_token": chunk_bytes // block_size,
            "block_size": block_size,
            "eviction_policy": args.policy,
        },
    })
    spec = CPUOffloadingSpec(config)
    manager = spec.get_manager()
    tensors, kv = random_kv_caches(num_blocks, [page] * args.layers, seed=args.seed)
    worker = spec.get_worker(kv)
    original = [t.clone() for t in tensors]
    print(f"engine: {args.layers} layers x {num_blocks} GPU blocks of {TOKENS_PER_BLOCK} tokens, "
          f"{args.page_kib} KiB per layer per block")
    print(f"CPU tier: {manager.num_chunks} chunks of {block_size} tokens = {chunk_bytes // 1024} KiB "
          f"({worker.pool.nbytes / 2**20:.1f} MiB host pool{', pinned' if worker.pool.pinned else ''}), "
          f"policy {args.policy}\n")

    job = 0
    moved = {"store": [0, 0.0], "load": [0, 0.0]}

    def transfer(direction, gpu_blocks, cpu_spec):
        nonlocal job
        job += 1
        gpu = GPULoadStoreSpec(gpu_blocks)
        ok = worker.submit_store(job, gpu, cpu_spec) if direction == "store" else worker.submit_load(job, cpu_spec, gpu)
        assert ok, worker.last_error
        worker.wait({job})
        for r in worker.get_finished():
            assert r.success, f"{direction} job {r.job_id} failed"
            moved[direction][0] += r.transfer_size
            moved[direction][1] += r.transfer_time

    requests = {"A": (chunk_keys("request A", n), list(range(0, 2 * n))),
                "B": (chunk_keys("request B", n), list(range(2 * n, 4 * n)))}
    for name, (keys, blocks) in requests.items():
        ctx = ReqContext(name)
        out = manager.prepare_store(keys, ctx)
        if out is None:
            print(f"request {name} ({n} chunks) does not fit in {manager.num_chunks} CPU chunks: not stored")
            continue
        transfer("store", blocks, out.store_spec)
        manager.complete_store(keys, ctx)
        evicted = ""
        if out.evicted_keys:
            where = [f"{r}[{ks.index(k)}]" for k in out.evicted_keys for r, (ks, _) in requests.items() if k in ks]
            evicted = f", evicted {len(out.evicted_keys)} to make room: {' '.join(where)}"
        print(f"stored request {name}: {len(out.keys_to_store)} chunks{evicted}")

    ok = True
    free = iter(range(4 * n, num_blocks))
    for name, (keys, blocks) in requests.items():
        ctx = ReqContext(name + "'")
        hits = 0
        for k in keys:  # an engine loads the longest stored prefix
            if manager.lookup(k, ctx) != LookupResult.HIT:
                break
            hits += 1
        if hits:
            dst = [next(free) for _ in range(2 * hits)]
            spec_ = manager.prepare_load(keys[:hits], ctx)
            transfer("load", dst, spec_)
            manager.complete_load(keys[:hits], ctx)
            same = all(torch.equal(t[dst], o[blocks[: 2 * hits]]) for t, o in zip(tensors, original))
            ok &= same
        print(f"request {name} again: {hits}/{n} chunks hit"
              + (f", loaded into GPU blocks {dst[0]}..{dst[-1]}, bytes {'identical' if same else 'DIFFER'}"
                 if hits else ""))

    stats = manager.get_stats()
    c, g = stats.counters, stats.gauges
    print(f"\nmanager: {c['lookups']} lookups, {c['hits']} hits, {c['misses']} misses, "
          f"{c['evictions']} evictions, usage {g['usage']:.0%}")
    for direction, (nbytes, secs) in moved.items():
        rate = f"{nbytes / secs / 1e9:.1f} GB/s" if secs else "-"
        print(f"worker {direction}: {nbytes / 2**20:.1f} MiB at {rate}")
    worker.shutdown()
    if not moved["load"][0]:
        print("\nnothing was loaded (no hits): grow --cpu-chunks")
    else:
        print("\nverified: every loaded byte matches what was stored" if ok else "\nFAILED: loaded bytes differ")
    return 0 if ok else 1
