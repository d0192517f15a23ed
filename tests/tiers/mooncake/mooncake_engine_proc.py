"""An 'engine' in its own process, for the cross-process test:

    python mooncake_engine_proc.py MASTER METADATA PREFIX SEED N -> stores N chunks of known bytes, exits 0
"""

import sys

from mooncake_helpers import fill, keys_for, make_tier, store


class _Srv:
    def __init__(self, master: str, metadata: str):
        self.master_address, self.metadata_server = master, metadata

    def tier_config(self, **kw):
        return {"master_address": self.master_address, "metadata_server": self.metadata_server, **kw}


def main(master: str, metadata: str, prefix: str, seed: int, n: int) -> int:
    tier, m, w, pool = make_tier(_Srv(master, metadata), prefix, num_chunks=n)
    try:
        fill(pool, range(n), seed=seed)
        return 0 if store(m, w, keys_for(n, seed=seed), list(range(n))) else 1
    finally:
        tier.shutdown()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])))
