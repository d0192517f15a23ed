"""KV event encoding cost per block: kvoffload's EventEncoder + msgpack (the
bytes ZmqEventPublisher sends) against vLLM's own path for the same events,
in the same run: vLLM's BlockStored/BlockRemoved structs encoded by msgspec
(what vLLM's publisher does). Best of --repeat runs (a noisy machine).

    .venv/bin/python benchmarks/bench_events.py [--blocks 20000] [--batch 16] [--repeat 30]
    [--baseline OLD_EVENTS_PY]   # also an older events.py (e.g. `git show REV:src/kvoffload/events.py`)
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time

import msgpack

from kvoffload.abstractions import Medium, OffloadingEvent
from kvoffload.events import EventEncoder
from kvoffload.keys import make_offload_key


def _batches(keys, batch):
    stores = [OffloadingEvent(keys[i:i + batch], Medium.CPU, False) for i in range(0, len(keys), batch)]
    removes = [OffloadingEvent(keys[i:i + batch], Medium.CPU, True) for i in range(0, len(keys), batch)]
    return stores + removes


def ours(make):
    def run(events):
        enc = make()
        t = time.perf_counter()
        for ev in events:
            msgpack.packb([0.0, enc.encode([ev]), None], use_bin_type=True)
        return time.perf_counter() - t
    return run


def vllms():
    import msgspec
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

    encoder = msgspec.msgpack.Encoder()

    def run(events):
        t = time.perf_counter()
        for ev in events:
            hashes = [int.from_bytes(k[-12:-4], "big") for k in ev.keys]
            if ev.removed:
                e = BlockRemoved(block_hashes=hashes, medium="CPU", group_idx=0)
            else:
                e = BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[], block_size=0,
                                lora_id=None, medium="CPU", lora_name=None, group_idx=0)
            encoder.encode(KVEventBatch(ts=0.0, events=[e]))
        return time.perf_counter() - t
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=20_000)
    ap.add_argument("--batch", type=int, default=16, help="blocks per manager event")
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--baseline", help="an older events.py to time as well")
    a = ap.parse_args()
    keys = [make_offload_key(i.to_bytes(32, "big"), 0) for i in range(a.blocks)]
    events = _batches(keys, a.batch)
    runs = {"map": ours(lambda: EventEncoder(event_format="map")),
            "array": ours(lambda: EventEncoder(event_format="array"))}
    if a.baseline:
        spec = importlib.util.spec_from_file_location("events_baseline", a.baseline)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["events_baseline"] = mod
        spec.loader.exec_module(mod)
        runs["baseline"] = ours(mod.EventEncoder)
    try:
        runs["vllm"] = vllms()
    except ImportError:
        print("vLLM not installed: no reference", file=sys.stderr)
    best = {k: float("inf") for k in runs}
    for _ in range(a.repeat):
        for k, run in runs.items():  # interleaved: the machine's noise hits all alike
            best[k] = min(best[k], run(events))
    n = 2 * a.blocks
    ref = best.get("vllm")
    for k, v in best.items():
        ratio = f"  {v / ref:.2f}x vLLM's" if ref else ""
        print(f"{k:9} {v / n * 1e9:7.0f} ns/block{ratio}")


if __name__ == "__main__":
    main()
