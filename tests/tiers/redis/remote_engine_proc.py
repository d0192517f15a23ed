"""An 'engine' in its own process, for the cross-process test:

    python remote_engine_proc.py URL PREFIX SEED N   -> stores N chunks of known bytes, exits 0
"""

import sys

from remote_helpers import fill, keys_for, make_tier, store


def main(url: str, prefix: str, seed: int, n: int) -> int:
    tier, m, w, pool = make_tier(url, prefix, num_chunks=n)
    try:
        fill(pool, range(n), seed=seed)
        return 0 if store(m, w, keys_for(n, seed=seed), list(range(n))) else 1
    finally:
        tier.shutdown()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
