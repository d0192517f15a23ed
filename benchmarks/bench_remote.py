"""Remote tier benchmark, against references measured in the same run.

1. Bandwidth: the remote worker storing / loading host-pool chunks
   (pipelined, zero-copy sends, reads straight into the pool), as a ratio
   of `redis-benchmark` SET / GET with the same value size, connection
   count (--connections: redis-benchmark -c, our io_threads) and pipeline
   depth (-P; our batch_bytes = P x value size: at most P commands
   outstanding per connection on both sides), on the same server, in the
   same run. redis-benchmark's GET is credited only with the GETs that
   returned a value (see redis_benchmark()). Loads are measured twice: in
   jobs of P chunks, and as one load job of all the chunks (split over the
   connections). redis-py pipelines (copying values into bytes objects) are
   shown too (one connection).
2. Sharing: the shared Mooncake trace split round-robin across two
   simulated engines (kvoffload's replay engine, in two threads at once),
   each with a small CPU tier, over one remote tier; once with the engines
   isolated (a key prefix each) and once sharing one prefix. The gain is
   the cross-instance hits: blocks one engine computed and the other
   reused, their bytes verified on load.
3. (--mac-cost) What the shared secret (remote.mac_key_file: BLAKE2b keyed
   MAC over key + header + payload) costs: our store / load with and
   without it, alternating runs, and the ratio; plus the single-thread
   rates of the two hashes over the same bytes.

    .venv/bin/python benchmarks/bench_remote.py            # parts 1 and 2
    .venv/bin/python benchmarks/bench_remote.py --requests 12031 --plot docs/remote_bench.png
    .venv/bin/python benchmarks/bench_remote.py --skip-bandwidth --skip-replay --mac-cost
    .venv/bin/python benchmarks/bench_remote.py --skip-replay --mooncake   # parts 1 and 4 side by side
    .venv/bin/python benchmarks/bench_remote.py --skip-replay --connections 1,2,4

4. (--mooncake) The Mooncake Store tier (a real mooncake_master and a
   mooncake_client store node on loopback, values held by the node): our
   worker storing / loading host-pool chunks (registered pool, batched
   zero-copy put/get of header + slot, header checked on load) as a ratio
   of the Mooncake client's own batch_put_from / batch_get_into of the same
   values from / into the same registered slots, in the same run and with
   the same values per call; beside the Redis tier's rates from part 1.
   How it is measured: benchmarks/mooncake_bandwidth.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvoffload.config import parse_bytes
from kvoffload.tiers.redis.server import LocalServer, find_benchmark_binary
from shared_traces import shared_trace_path
from mooncake_bandwidth import mooncake_bandwidth, print_mooncake
from remote_bandwidth import bandwidth, plot, print_bandwidth
from remote_mac_cost import mac_cost, print_mac_cost
from remote_sharing import infinite_cache_rates, print_sharing, two_engines

TRACE = shared_trace_path()


def _json_or_str(v: str):
    try:
        return json.loads(v)
    except ValueError:
        return v


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="256KiB,1MiB,4MiB", help="value sizes")
    ap.add_argument("--total", default="256MiB", help="bytes moved per size and run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pipeline", type=int, default=16, help="values per pipeline round (redis-benchmark -P)")
    ap.add_argument("--connections", default="1", help="connection counts to measure, e.g. 1,2,4 (redis-benchmark "
                    "-c; our io_threads)")
    ap.add_argument("--trace", default=str(TRACE.resolve()))
    ap.add_argument("--requests", type=int, default=2000, help="trace requests replayed (12031: all)")
    ap.add_argument("--cpu-share", type=float, default=0.05, help="CPU tier per engine, share of unique blocks")
    ap.add_argument("--tier", action="append", default=[], metavar="KEY=VALUE",
                    help="remote tier setting for the replay, e.g. miss_cache_s=2 (VALUE as JSON)")
    ap.add_argument("--skip-bandwidth", action="store_true")
    ap.add_argument("--skip-replay", action="store_true")
    ap.add_argument("--plot", help="write a PNG of the bandwidth table here")
    ap.add_argument("--mac-cost", action="store_true", help="also measure store / load with and without the MAC")
    ap.add_argument("--mooncake", action="store_true", help="also measure the Mooncake tier (part 4)")
    ap.add_argument("--mooncake-io-threads", type=int, help="the Mooncake tier's io_threads (part 4; default: "
                    "the tier's)")
    ap.add_argument("--mooncake-store", default="6GiB",
                    help="memory the store node lends for --replay-mooncake (the whole trace stores ~1.7 GB "
                         "per run; a full store evicts)")
    ap.add_argument("--mooncake-no-checksum", action="store_true",
                    help="part 4 with the tier's checksums off (a constant header, no check): what they cost; "
                         "benchmark only")
    ap.add_argument("--mooncake-json", help="also write part 4's rows, with each repeat's GB/s, to this JSON file")
    ap.add_argument("--replay-mooncake", action="store_true",
                    help="also run part 2 with the Mooncake tier as the shared remote tier")
    args = ap.parse_args(argv)
    if find_benchmark_binary() is None and not args.skip_bandwidth:
        sys.exit("redis-benchmark not found (Debian: apt-get install redis-server)")
    sizes = [parse_bytes(s, "--sizes") for s in args.sizes.split(",")]
    rows = None
    with LocalServer(maxmemory="3gb") as srv:
        print(f"server: {srv.binary} on 127.0.0.1:{srv.port}, no persistence, allkeys-lru")
        if not args.skip_bandwidth:
            rows = bandwidth(srv, sizes, parse_bytes(args.total, "--total"), args.repeats, args.pipeline,
                             [int(c) for c in args.connections.split(",")])
            print_bandwidth(rows, args.pipeline)
            if args.plot:
                plot(rows, args.plot)
        if args.mac_cost:
            rows = mac_cost(srv, sizes, parse_bytes(args.total, "--total"), args.repeats, args.pipeline)
            print_mac_cost(rows, args.pipeline, args.repeats)
        if not args.skip_replay:
            from tqdm import tqdm

            conf = {k: _json_or_str(v) for k, v in (kv.split("=", 1) for kv in args.tier)}
            with tqdm(total=2, desc="two-engine replay", unit="run") as bar:
                iso = two_engines(srv.url, Path(args.trace), args.requests, args.cpu_share, False, conf)
                bar.update()
                sh = two_engines(srv.url, Path(args.trace), args.requests, args.cpu_share, True, conf)
                bar.update()
            print_sharing(iso, sh, args.requests, infinite_cache_rates(Path(args.trace), args.requests))
    if args.mooncake:
        mc = mooncake_bandwidth(sizes, parse_bytes(args.total, "--total"), args.repeats, args.pipeline,
                                args.mooncake_io_threads, args.mooncake_no_checksum)
        print_mooncake(mc, args.pipeline, rows)
        if args.mooncake_json:
            Path(args.mooncake_json).write_text(json.dumps(mc, indent=1))
    if args.replay_mooncake:
        from kvoffload.tiers.mooncake.server import LocalMooncake

        with LocalMooncake(store_bytes=parse_bytes(args.mooncake_store, "--mooncake-store")) as mc_srv:
            conf = {**mc_srv.tier_config(segment_bytes=0),
                    **{k: _json_or_str(v) for k, v in (kv.split("=", 1) for kv in args.tier)}}
            runs = [two_engines("", Path(args.trace), args.requests, args.cpu_share, shared, conf, "mooncake")
                    for shared in (False, True)]
        print_sharing(*runs, args.requests, infinite_cache_rates(Path(args.trace), args.requests), "mooncake")
    return 0


if __name__ == "__main__":
    sys.exit(main())
