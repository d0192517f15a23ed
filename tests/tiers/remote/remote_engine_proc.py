"""One 'engine' in its own process, for the cross-process test:

    python remote_engine_proc.py store URL PREFIX SEED N   -> stores N chunks
    python remote_engine_proc.py load  URL PREFIX SEED N   -> prints 'hits=H exact=E'

The loader prints 'ready' once set up and waits for a line on stdin, so a
test can start both processes at once (imports are slow here) and order
only the work.
"""

import sys

import numpy as np

from kvoffload.abstractions import LookupResult
from remote_helpers import expected, fill, keys_for, load, lookup, make_tier, store


def main(mode: str, url: str, prefix: str, seed: int, n: int) -> int:
    tier, m, w, pool = make_tier(url, prefix, num_chunks=n)
    try:
        keys = keys_for(n, seed=seed)
        if mode == "store":
            fill(pool, range(n), seed=seed)
            return 0 if store(m, w, keys, list(range(n))) else 1
        print("ready", flush=True)
        sys.stdin.readline()
        hits = [k for k in keys if lookup(m, k) is LookupResult.HIT]
        exact = 0
        if hits and load(m, w, hits, list(range(len(hits)))):
            exact = sum(np.array_equal(pool.chunk(j)[: pool.used_chunk_bytes], expected(pool, seed, j))
                        for j in range(len(hits)))
        print(f"hits={len(hits)} exact={exact}")
        return 0
    finally:
        tier.shutdown()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])))
