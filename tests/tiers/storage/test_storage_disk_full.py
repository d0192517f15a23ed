"""A full disk under an open storage tier: stores fail (misses later), nothing
acknowledged is lost, a cache reset holds across a restart, and nothing
raises into the engine.

The disk fills in a child process through RLIMIT_FSIZE (no mount, no root):
a write crossing the limit is cut short, the next one fails with EFBIG, just
as a filesystem running out of space writes what fits, then fails with ENOSPC.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from kvoffload.abstractions import LookupResult
from storage_helpers import CTX, expected, key, load

RECORD = 128
HERE = os.path.dirname(__file__)

PRELUDE = f"""
import json, os, resource, signal, sys
sys.path.insert(0, {HERE!r})
from kvoffload.abstractions import LookupResult
from kvoffload.tiers.host_pool import HostPool
from kvoffload.tiers.storage.tier import StorageTier
from storage_helpers import CHUNK, CTX, NS, close, fill, key, store

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death past the limit

def disk_full(limit):
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))

def disk_freed():
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
"""

STORES = PRELUDE + """
path, limit, n = sys.argv[1], int(sys.argv[2]), 200
pool = HostPool(1, CHUNK)
tier = StorageTier(path, 4 * CHUNK, CHUNK, NS, num_files=4)  # one 16 KiB slot per slab file, under the limit
disk_full(limit)
acked = []
for i in range(n):  # 4 slots: from the 5th store on, each evicts (a FREE, then a PUT)
    fill(pool, 0, key(i))
    if store(tier, pool, [key(i)], [0], job_id=i + 1):
        acked.append(i)
disk_freed()
held = [i for i in range(n) if tier.get_manager().lookup(key(i), CTX) is LookupResult.HIT]
print(json.dumps({"acked": acked, "held": held, "log": os.path.getsize(tier.store.dir / "index.log")}))
close(tier)
"""


def _child(script: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True,
                          timeout=300)


def _served_right(tier, pool, k) -> bool:
    return load(tier, pool, [k], [0], job_id=99) and np.array_equal(pool.chunk(0), expected(k))


# the limit falls inside a record: on a PUT (a store's own record), or on a
# FREE (written before an evicted slot is overwritten)
@pytest.mark.parametrize("torn", ["put", "free"])
def test_a_short_index_write_fails_the_store_and_loses_nothing(tmp_path, make_tier, pool, torn):
    # records: header, 4 PUTs, then FREE (odd index), PUT (even) per store; record 128 is a PUT
    limit = 16 * 1024 + (RECORD // 2 if torn == "put" else RECORD + RECORD // 2)
    out = _child(STORES, tmp_path / "store", limit)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert 4 < len(r["acked"]) < 200  # some stores landed, then the disk was full
    assert r["log"] % RECORD == 0  # the cut record was taken back
    assert r["held"] and set(r["held"]) <= set(r["acked"])
    tier = make_tier(capacity_slots=4, num_files=4)  # a restart, with room again
    mgr = tier.get_manager()
    for i in range(200):
        if mgr.lookup(key(i), CTX) is LookupResult.HIT:
            assert i in r["acked"] and _served_right(tier, pool, key(i)), i  # never a failing or wrong hit
        else:
            assert i not in r["held"], i  # acknowledged and still held at the restart: not lost


RESET = PRELUDE + """
path, pinned = sys.argv[1], sys.argv[2] == "1"
pool = HostPool(8, CHUNK)
tier = StorageTier(path, 8 * CHUNK, CHUNK, NS)
mgr = tier.get_manager()
keys = [key(i) for i in range(6)]
for c, k in enumerate(keys):
    fill(pool, c, k)
assert store(tier, pool, keys[:5], list(range(5)))
if pinned:
    mgr.prepare_load([keys[4]], CTX)  # a load in flight: the reset keeps key 4
disk_full(64)  # not one more index record fits
mgr.reset_cache()
after = [mgr.lookup(k, CTX).name for k in keys]
if pinned:
    mgr.complete_load([keys[4]], CTX)
disk_freed()
assert store(tier, pool, keys[5:], [5], job_id=2)  # room again: the next store lands
print(json.dumps(after))
close(tier)
"""


@pytest.mark.parametrize("pinned", [False, True])
def test_reset_on_a_full_disk_holds_across_a_restart(tmp_path, make_tier, pinned):
    out = _child(RESET, tmp_path / "store", int(pinned))
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.splitlines()) <= 1, out.stderr
    assert json.loads(out.stdout) == ["MISS"] * 4 + ["HIT" if pinned else "MISS", "MISS"]
    mgr = make_tier(capacity_slots=8).get_manager()  # a restart
    # the reset blocks never come back; the kept one is back on disk with the next store
    want = [LookupResult.MISS] * 4 + [LookupResult.HIT if pinned else LookupResult.MISS, LookupResult.HIT]
    assert [mgr.lookup(key(i), CTX) for i in range(6)] == want
