"""Helpers for storage-tier tests: real slab files under pytest's tmp_path."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from kvoffload.abstractions import CPULoadStoreSpec, ReqContext
from kvoffload.keys import make_offload_key
from kvoffload.tiers.base import Namespace
from kvoffload.tiers.host_pool import HostPool
from kvoffload.tiers.storage.tier import StorageTier

CHUNK = 16 * 1024
NS = Namespace(model="test-model", dtype="float16", layout="test", block_size=16, chunk_bytes=CHUNK)
CTX = ReqContext("r")


def key(i: int) -> bytes:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def fill(pool: HostPool, chunk: int, k: bytes) -> None:
    """Bytes that depend on the key, so a mixed-up slot is caught."""
    seed = int.from_bytes(k[:8], "big")
    pool.chunk(chunk).view(np.uint64)[:] = np.arange(seed, seed + CHUNK // 8, dtype=np.uint64) * 2654435761


def expected(k: bytes) -> np.ndarray:
    seed = int.from_bytes(k[:8], "big")
    return (np.arange(seed, seed + CHUNK // 8, dtype=np.uint64) * 2654435761).view(np.uint8)


def store(tier: StorageTier, pool: HostPool, keys: list[bytes], chunks: list[int], job_id: int = 1) -> bool:
    """Write host chunks to storage through manager + worker; True if it landed."""
    mgr, worker = tier.get_manager(), tier.get_worker(pool)
    out = mgr.prepare_store(keys, CTX)
    assert out is not None
    idx = [keys.index(k) for k in out.keys_to_store]
    worker.submit_store(job_id, CPULoadStoreSpec([chunks[i] for i in idx]), out.store_spec)
    worker.wait({job_id})
    (res,) = worker.get_finished()
    mgr.complete_store(out.keys_to_store, CTX, success=res.success)
    return res.success


def load(tier: StorageTier, pool: HostPool, keys: list[bytes], chunks: list[int], job_id: int = 2) -> bool:
    mgr, worker = tier.get_manager(), tier.get_worker(pool)
    spec = mgr.prepare_load(keys, CTX)
    worker.submit_load(job_id, spec, CPULoadStoreSpec(chunks))
    worker.wait({job_id})
    (res,) = worker.get_finished()
    mgr.complete_load(keys, CTX)
    return res.success


def close(tier: StorageTier) -> None:
    if tier._worker is not None:
        tier._worker.shutdown()
    tier.get_manager().shutdown()


_OPEN_IN_CHILD = f"""
import sys
sys.path.insert(0, {os.path.dirname(__file__)!r})
from kvoffload.tiers.storage.store import StorageError
from kvoffload.tiers.storage.tier import StorageTier
from storage_helpers import CHUNK, NS
try:
    StorageTier(sys.argv[1], int(sys.argv[2]) * CHUNK, CHUNK, NS)
except StorageError as e:
    print(e)
    sys.exit(3)
"""


def open_in_child(path, slots: int, timeout: float = 120) -> subprocess.CompletedProcess:
    """Open a tier on path in another process: rc 3 and the StorageError's
    line on stdout if refused (the time limit keeps a hang from hanging the suite)."""
    return subprocess.run([sys.executable, "-c", _OPEN_IN_CHILD, str(path), str(slots)],
                          capture_output=True, text=True, timeout=timeout)
