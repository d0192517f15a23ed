"""Crash rounds on real files: a child process stores blocks of random bytes
in a loop and is SIGKILLed at random points; the reopened tier may have lost
recent stores (misses), but every block it serves equals the bytes stored
for its key. A clean close, or a kill after a commit, loses nothing."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from kvoffload.abstractions import LookupResult
from kvoffload.tiers.host_pool import HostPool
from kvoffload.tiers.storage.tier import StorageTier
from storage_helpers import CHUNK, CTX, NS, close, key, load

HERE = os.path.dirname(__file__)
SLOTS, KEYS = 48, 200  # fewer slots than keys: stores keep overwriting evicted slots

CHILD = f"""
import json, random, sys, time
sys.path.insert(0, {HERE!r})
import numpy as np
from kvoffload.tiers.host_pool import HostPool
from kvoffload.tiers.storage.tier import StorageTier
from storage_helpers import CHUNK, NS, close, key, store
from test_storage_crash import SLOTS, KEYS, block

path, seed, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rng = random.Random(seed)
tier = StorageTier(path, SLOTS * CHUNK, CHUNK, NS, commit_interval_ms=20)
pool = HostPool(8, CHUNK)
job = 0
batches = 40 if mode != "storm" else 1 << 30
for b in range(batches):
    ks = list(dict.fromkeys(rng.randrange(KEYS) for _ in range(rng.randint(1, 8))))
    for c, k in enumerate(ks):
        pool.chunk(c)[:] = block(k)
    job += 1
    store(tier, pool, [key(k) for k in ks], list(range(len(ks))), job_id=job)
    if mode == "storm" and b == 3:
        print("storing", flush=True)
held = sorted(k for k in range(KEYS) if key(k) in tier.get_manager()._slot_of)
if mode == "committed":  # a commit, then killed: nothing held may be lost
    assert tier.store.flush()
    print(json.dumps(held), flush=True)
    time.sleep(3600)
print(json.dumps(held), flush=True)
close(tier)  # a clean close commits what waits
"""


def block(k: int) -> np.ndarray:
    """The random bytes stored for key k (the parent recomputes them)."""
    return np.random.default_rng(1_000_003 * k + 17).integers(0, 256, CHUNK, dtype=np.uint8)


def _child(path, seed: int, mode: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-c", CHILD, str(path), str(seed), mode], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _served(path, pool: HostPool) -> tuple[list[int], list[int]]:
    """Reopen: (keys served, keys held but failing their load). Each key is
    loaded alone and its bytes compared with what was stored for it."""
    tier = StorageTier(str(path), SLOTS * CHUNK, CHUNK, NS)
    try:
        mgr = tier.get_manager()
        held = [k for k in range(KEYS) if mgr.lookup(key(k), CTX) is LookupResult.HIT]
        served, failed = [], []
        for job, k in enumerate(held):
            if load(tier, pool, [key(k)], [0], job_id=job):
                np.testing.assert_array_equal(pool.chunk(0), block(k), err_msg=f"key {k}: a wrong byte served")
                served.append(k)
            else:
                failed.append(k)
                assert mgr.lookup(key(k), CTX) is LookupResult.MISS  # dropped, never served
        assert mgr.get_stats().counters.get("checksum_failures", 0) == len(failed)
    finally:
        close(tier)
    return served, failed


@pytest.fixture
def pool():
    p = HostPool(1, CHUNK)
    yield p
    p.close()


@pytest.mark.slow
def test_kill_minus_nine_rounds_never_serve_a_wrong_byte(tmp_path, pool):
    path = tmp_path / "store"
    rng = random.Random(int.from_bytes(os.urandom(4), "big"))
    for round_ in range(8):
        child = _child(path, rng.randrange(1 << 30), "storm")
        try:
            assert child.stdout.readline() == "storing\n", child.stderr.read()
            time.sleep(rng.uniform(0, 0.3))  # a random point: mid-write, mid-commit, between stores
        finally:
            child.send_signal(signal.SIGKILL)
            child.communicate()
        assert child.returncode == -signal.SIGKILL, f"round {round_}: the child ended on its own"
        _served(path, pool)  # asserts every served block's bytes
    child = _child(path, rng.randrange(1 << 30), "committed")  # the last round: killed after a commit
    try:
        held = json.loads(child.stdout.readline() or "null")
        assert held, child.stderr.read()
    finally:
        child.send_signal(signal.SIGKILL)
        child.communicate()
    served, failed = _served(path, pool)
    assert served == held and not failed  # a commit bounds the loss: nothing committed is lost


def test_a_clean_close_loses_nothing(tmp_path, pool):
    """Stores are acknowledged before their records are committed; the
    close commits them, so a restart serves every block held at the close."""
    child = _child(tmp_path / "store", 7, "close")
    out, err = child.communicate(timeout=300)
    assert child.returncode == 0, err
    held = json.loads(out)
    assert len(held) == SLOTS  # 40 batches filled every slot
    served, failed = _served(tmp_path / "store", pool)
    assert served == held and not failed


def _eventually(check, what: str, limit_s: float = 60.0) -> None:
    """Poll until check() holds (the commit thread runs on its own)."""
    end = time.monotonic() + limit_s
    while not check():
        assert time.monotonic() < end, f"never: {what}"
        time.sleep(0.01)


@pytest.mark.parametrize("trigger", ["records", "interval"])
def test_the_group_commit_writes_records_without_a_close(tmp_path, pool, trigger):
    """Stores reach the log on their own: once commit_records wait, or when
    the commit interval ends (nothing here waits for a close or a flush)."""
    from storage_helpers import fill, store

    kw = {"commit_records": 3, "commit_interval_ms": 60_000} if trigger == "records" else \
        {"commit_records": 10_000, "commit_interval_ms": 10}
    tier = StorageTier(str(tmp_path / "store"), 8 * CHUNK, CHUNK, NS, **kw)
    log = tier.store.dir / "index.log"
    try:
        for i in range(3):
            fill(pool, 0, key(i))
            assert store(tier, pool, [key(i)], [0], job_id=i + 1)
        _eventually(lambda: log.stat().st_size == 4 * 128, "a header and 3 records in the log")
    finally:
        close(tier)


def test_uncommitted_records_counts_what_a_kill_would_lose(tmp_path, pool):
    """The gauge an operator (or a test stopping vLLM, which kills its engine
    core at once) waits on: the stores not in the index log yet, then 0 once
    a commit wrote them, and a new process finds every one of them."""
    from storage_helpers import fill, store

    tier = StorageTier(str(tmp_path / "store"), 8 * CHUNK, CHUNK, NS, commit_records=10_000,
                       commit_interval_ms=60_000)  # commits only where called
    mgr = tier.get_manager()
    try:
        assert mgr.get_stats().gauges["uncommitted_records"] == 0
        for i in range(3):
            fill(pool, 0, key(i))
            assert store(tier, pool, [key(i)], [0], job_id=i + 1)
        assert mgr.get_stats().gauges["uncommitted_records"] == 3
        tier.store.flush()
        assert mgr.get_stats().gauges["uncommitted_records"] == 0
        log_bytes = (tier.store.dir / "index.log").read_bytes()
    finally:
        close(tier)
    assert len(log_bytes) == 4 * 128  # a header and the 3 records, before the close committed anything


@pytest.mark.parametrize("value", [0, -5, "fast", True, 120_000])
def test_commit_interval_out_of_range_is_named(tmp_path, value):
    from kvoffload.config import ConfigError
    from kvoffload.tiering import TierContext

    ctx = TierContext(0, "storage", NS, CHUNK, False)
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\] \(storage\)\.commit_interval_ms") as e:
        StorageTier.from_config({"path": str(tmp_path / "s"), "capacity_bytes": "1MiB",
                                 "commit_interval_ms": value}, ctx)
    assert "\n" not in str(e.value) and not (tmp_path / "s").exists()
