"""A Mooncake tier on a host pool for tests; the engine-step drivers
(store / lookup / load with RETRY stepped) are the Redis tier tests' own."""

from __future__ import annotations

import sys
from pathlib import Path

from kvoffload.tiers.base import Namespace
from kvoffload.tiers.host_pool import HostPool
from kvoffload.tiers.mooncake import MooncakeTier

sys.path.insert(0, str(Path(__file__).parent.parent / "redis"))
from remote_helpers import CTX, STEP, expected, fill, keys_for, load, lookup, store, total, wait_until  # noqa: E402

__all__ = ["CTX", "STEP", "expected", "fill", "keys_for", "load", "lookup", "store", "total", "wait_until",
           "make_tier", "PATIENT"]

# A healthy store on a loaded machine: the 0.5 s lookup deadline could turn a HIT into a MISS.
PATIENT = dict(rpc_timeout_s=30.0, connect_timeout_s=10.0, lookup_deadline_s=30.0)


def make_tier(srv, prefix: str, num_chunks: int = 32, chunk_bytes: int = 64 << 10, **cfg):
    """A tier lending no memory (segment_bytes 0): the store node holds the data, so it outlives us."""
    pool = HostPool(num_chunks, chunk_bytes, trailer_bytes=MooncakeTier.POOL_TRAILER_BYTES)
    ns = Namespace(model="tiny", dtype="bf16", layout="canon", block_size=16, chunk_bytes=pool.used_chunk_bytes)
    tier = MooncakeTier(srv.tier_config(key_prefix=prefix, **{"segment_bytes": 0, **PATIENT, **cfg}), ns)
    return tier, tier.get_manager(), tier.get_worker(pool), pool
