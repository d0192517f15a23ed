"""Running replays for the CLI: one, or one per capacity of a --sweep (and
per policy of a --policy list), in parallel processes when the machine has
cores to spare.

The parallel replays are forked (where the platform can): each child has
the parent's trace without pickling millions of block hashes, and sends
back only its result. A replay's outcome does not depend on which process
runs it (vLLM's order lands every job a fixed step after its submission),
so a parallel sweep prints what the sequential one prints.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor

from kvoffload.replay.traces import Trace

_TRACE: Trace | None = None  # the trace a forked child replays (set just before forking)


def replay_once(trace: Trace, opts, oracle: bool):
    from kvoffload.replay.engine import replay
    from kvoffload.replay.oracle import replay_oracles

    result = replay(trace, opts)
    for key in ("metrics", "events"):  # live objects: a report holds what they are, not them
        if result.options.get(key) is not None:
            result.options[key] = type(result.options[key]).__name__
    if oracle:
        result.oracle = replay_oracles([r.block_hashes for r in trace.requests], result.tiers,
                                       opts.extra_config.get("num_cpu_chunks"))
    return result


def usable_cores() -> int:
    """Cores this process may run on (its affinity, else the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def default_workers(points: int) -> int:
    return max(1, min(points, usable_cores()))


def fit_workers(sizes: list[int], workers: int, available: int | None) -> int:
    """At most `workers` replays at once, and no more than the memory holds
    even when the biggest of them run together (each has its own pool and
    simulated GPU cache); at least one."""
    if available is None:
        return max(1, workers)
    n, total = 0, 0
    for size in sorted(sizes, reverse=True)[:workers]:
        total += size
        if total > available:
            break
        n += 1
    return max(1, n)


def _replay_forked(opts, oracle: bool):
    return replay_once(_TRACE, opts, oracle)


def run_sweep(trace: Trace, options: list, oracles: list[bool], workers: int,
              done: Callable[[int, object], None]) -> list:
    """Replay each of `options` (in `workers` processes at most), the
    oracles simulated beside those marked in `oracles`; done(i, result) is
    called in the options' order as results come in. Runs in this process
    when one worker is asked for, when an option holds live objects (a
    metrics endpoint or event publisher shared by every replay), or where
    processes cannot be forked."""
    shared = any(o.metrics is not None or o.events is not None for o in options)
    if workers <= 1 or len(options) <= 1 or shared or "fork" not in multiprocessing.get_all_start_methods():
        results = []
        for i, opts in enumerate(options):
            results.append(replay_once(trace, opts, oracles[i]))
            done(i, results[-1])
        return results
    global _TRACE
    _TRACE = trace
    try:
        # fork: the children start with the trace in memory; the parent has
        # run no replay (no copy thread, no torch thread pool) to fork over
        with ProcessPoolExecutor(min(workers, len(options)), mp_context=multiprocessing.get_context("fork")) as pool:
            futures = []
            for i, opts in enumerate(options):
                opts.progress_position = i  # each replay's bar on a line of its own
                futures.append(pool.submit(_replay_forked, opts, oracles[i]))
            results = []
            for i, f in enumerate(futures):
                results.append(f.result())
                done(i, results[-1])
            return results
    finally:
        _TRACE = None
