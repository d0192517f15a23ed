"""Bad directories fail clearly at start-up; IO failures at run time are
misses or failed stores, never exceptions into the engine."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from kvoffload.abstractions import LookupResult
from kvoffload.tiers.storage.store import StorageError
from kvoffload.tiers.storage.tier import StorageTier
from storage_helpers import CHUNK, CTX, NS, expected, fill, key, load, open_in_child, store


def test_path_under_a_file_is_a_clear_startup_error(tmp_path, make_tier):
    (tmp_path / "f").write_text("")
    with pytest.raises(StorageError, match=r"storage directory .*f/kv"):
        make_tier(path=tmp_path / "f" / "kv")


def test_no_space_is_a_clear_startup_error(tmp_path):
    with pytest.raises(StorageError, match="storage directory"):
        StorageTier(str(tmp_path / "big"), 2**60, CHUNK, NS)  # far beyond the disk


def test_capacity_below_one_slot_is_refused(tmp_path):
    with pytest.raises(StorageError, match="no slot"):
        StorageTier(str(tmp_path / "s"), CHUNK - 1, CHUNK, NS)


def test_second_opener_is_refused(tmp_path, make_tier):
    make_tier()
    with pytest.raises(StorageError, match="already open in this process"):
        make_tier()
    other = open_in_child(tmp_path / "store", 32)
    assert other.returncode == 3 and "in use by another process" in other.stdout, other




def test_vanished_directory_does_not_crash(tmp_path, make_tier, pool):
    tier = make_tier()
    fill(pool, 0, key(1))
    assert store(tier, pool, [key(1)], [0])
    shutil.rmtree(tmp_path / "store")
    fill(pool, 1, key(2))
    store(tier, pool, [key(2)], [1], job_id=5)  # may land in the unlinked files: no exception
    load(tier, pool, [key(1)], [2], job_id=6)


def test_io_errors_are_failed_jobs_and_misses(make_tier, pool):
    tier = make_tier()
    fill(pool, 0, key(1))
    assert store(tier, pool, [key(1)], [0])
    for fd in tier.store.fds:  # the disk goes away under the tier
        os.close(fd)
    tier.store.fds = [os.open("/dev/null", os.O_RDONLY) for _ in tier.store.fds]
    assert not store(tier, pool, [key(2)], [1], job_id=7)
    assert tier.get_manager().lookup(key(2), CTX) is LookupResult.MISS
    assert not load(tier, pool, [key(1)], [2], job_id=8)  # a failed read: the caller's miss
    assert tier.get_manager().get_stats().counters.get("checksum_failures", 0) == 0


def test_refused_open_leaves_no_lock_behind(tmp_path, make_tier):
    tier = make_tier()
    meta = tier.store.dir / "namespace.json"
    from storage_helpers import close

    close(tier)
    good = meta.read_text()
    meta.write_text('{"model": "someone else"}')
    with pytest.raises(StorageError, match="another namespace"):
        make_tier()
    meta.write_text(good)
    make_tier()  # the failed open released its lock


def test_capacity_beyond_the_filesystem_leaves_nothing_behind(tmp_path):
    with pytest.raises(StorageError, match="lower capacity_bytes") as e:
        StorageTier(str(tmp_path / "big" / "kv"), 2**50, CHUNK, NS)  # far beyond the disk
    assert "\n" not in str(e.value)
    assert not (tmp_path / "big").exists()


def test_failed_open_of_an_existing_directory_keeps_its_files(tmp_path, make_tier, pool):
    tier = make_tier(capacity_slots=8)
    fill(pool, 0, key(1))
    assert store(tier, pool, [key(1)], [0])
    d = tier.store.dir
    from storage_helpers import close

    close(tier)
    sizes = {f.name: f.stat().st_size for f in d.iterdir()}
    with pytest.raises(StorageError):
        StorageTier(str(tmp_path / "store"), 2**50, CHUNK, NS)
    assert {f.name: f.stat().st_size for f in d.iterdir()} == sizes
    assert make_tier(capacity_slots=8).get_manager().lookup(key(1), CTX) is LookupResult.HIT


@pytest.mark.parametrize("path", [5, 1.5, ["a"], {"p": 1}, True])
def test_path_must_be_a_string(tmp_path, monkeypatch, path):
    from kvoffload.config import ConfigError
    from kvoffload.tiering import TierContext

    monkeypatch.chdir(tmp_path)
    ctx = TierContext(0, "storage", NS, CHUNK, False)
    with pytest.raises(ConfigError, match=rf"secondary_tiers\[0\] \(storage\): path must be a directory name"):
        StorageTier.from_config({"path": path, "capacity_bytes": "1MiB"}, ctx)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("content", [None, b"", b"\0\0\0", b'{"model": "test-mo', b"[" * 30000 + b"]" * 30000])
def test_missing_empty_or_damaged_namespace_json(make_tier, pool, content):
    """Deleted, or left empty by a crash right after creation: with no chunk
    in the directory it is rebuilt; with chunks there it is a one-line error
    naming the file (never a directory of chunks reused as if fresh)."""
    from storage_helpers import close

    def spoil(meta):
        meta.unlink() if content is None else meta.write_bytes(content)

    tier = make_tier()
    meta = tier.store.dir / "namespace.json"
    good = meta.read_bytes()
    close(tier)
    spoil(meta)
    tier = make_tier()  # nothing stored yet: rebuilt
    assert meta.read_bytes() == good
    fill(pool, 0, key(1))
    assert store(tier, pool, [key(1)], [0])
    close(tier)
    spoil(meta)
    with pytest.raises(StorageError, match=rf"{meta} is (missing|empty|damaged).*delete") as e:
        make_tier()
    assert content is not None or not meta.exists()  # not rewritten behind the user's back
    assert "\n" not in str(e.value)
    meta.write_bytes(good)  # restored, as the message says: served again
    assert make_tier().get_manager().lookup(key(1), CTX) is LookupResult.HIT


def test_open_failing_late_removes_the_files_it_created(tmp_path):
    d = tmp_path / "store" / f"ns-{NS.digest()}"
    d.mkdir(parents=True, mode=0o700)
    (d / "index.log").mkdir()  # fails the open after the slab files were made
    with pytest.raises(StorageError, match=r"index.log") as e:
        StorageTier(str(tmp_path / "store"), 8 * CHUNK, CHUNK, NS)
    assert "\n" not in str(e.value)
    assert sorted(p.name for p in d.iterdir()) == ["index.log"]  # ours gone, the rest untouched


def test_an_unreadable_block_is_dropped_and_not_counted_as_loaded(make_tier, pool):
    """A slab cut short under the open tier (a short read; EIO takes the same
    path): the load fails, the block answers MISS from then on instead of
    failing every load, and only the good load is counted."""
    tier = make_tier(capacity_slots=8)
    mgr = tier.get_manager()
    for i in (0, 1):
        fill(pool, i, key(i))
    assert store(tier, pool, [key(0), key(1)], [0, 1])  # slots 0 and 1: slab-0 and slab-1
    os.truncate(tier.store.dir / "slab-0.bin", 0)
    assert mgr.lookup(key(0), CTX) is LookupResult.HIT
    assert not load(tier, pool, [key(0)], [2], job_id=5)
    assert mgr.lookup(key(0), CTX) is LookupResult.MISS
    assert mgr.lookup(key(0), CTX) is LookupResult.MISS
    assert load(tier, pool, [key(1)], [3], job_id=6)
    c = mgr.get_stats().counters
    assert c["load_failures"] == 1 and c.get("checksum_failures", 0) == 0, c
    assert c["loaded_blocks"] == 1 and c["loaded_bytes"] == CHUNK, c


def test_a_tier_failing_to_build_releases_its_directory(tmp_path):
    from kvoffload.config import ConfigError
    from storage_helpers import close

    with pytest.raises(ConfigError, match="eviction policy"):  # fails after the directory was opened
        StorageTier(str(tmp_path / "s"), 8 * CHUNK, CHUNK, NS, eviction_policy="lru_typo")
    close(StorageTier(str(tmp_path / "s"), 8 * CHUNK, CHUNK, NS))  # the retry in this process opens it


@pytest.mark.parametrize("policy", ["lru_typo", 5, None])
def test_a_bad_eviction_policy_is_named_before_anything_is_opened(tmp_path, policy):
    from kvoffload.config import ConfigError
    from kvoffload.tiering import TierContext

    ctx = TierContext(0, "storage", NS, CHUNK, False)
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\] \(storage\)\.eviction_policy") as e:
        StorageTier.from_config({"path": str(tmp_path / "s"), "capacity_bytes": "1MiB",
                                 "eviction_policy": policy}, ctx)
    assert "\n" not in str(e.value) and not (tmp_path / "s").exists()


def test_nul_byte_in_path_is_a_config_error(tmp_path):
    from kvoffload.config import ConfigError
    from kvoffload.tiering import TierContext

    ctx = TierContext(0, "storage", NS, CHUNK, False)
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\] \(storage\)\.path: contains a NUL byte"):
        StorageTier.from_config({"path": f"{tmp_path}/a\0b", "capacity_bytes": "1MiB"}, ctx)


@pytest.mark.parametrize("threads", [0, 10_000])
def test_io_threads_out_of_range_is_named_before_anything_is_opened(tmp_path, threads):
    from kvoffload.config import ConfigError
    from kvoffload.tiering import TierContext

    ctx = TierContext(0, "storage", NS, CHUNK, False)
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\] \(storage\)\.io_threads") as e:
        StorageTier.from_config({"path": str(tmp_path / "s"), "capacity_bytes": "1MiB", "io_threads": threads}, ctx)
    assert "\n" not in str(e.value) and not (tmp_path / "s").exists()


def test_a_bad_slot_inside_a_run_of_adjacent_slots_is_the_only_one_dropped(make_tier, pool):
    """Adjacent slots are read in one IO: a slab cut short in the middle of
    the run, or a flipped byte in one slot, costs those slots only."""
    tier = make_tier(capacity_slots=8, num_files=1)  # one file: the job's slots are adjacent
    mgr = tier.get_manager()
    keys = [key(i) for i in range(5)]
    for c, k in enumerate(keys):
        fill(pool, c, k)
    assert store(tier, pool, keys, list(range(5)))
    slots = [mgr._slot_of[k] for k in keys]
    assert slots == list(range(5))
    slab = tier.store.dir / "slab-0.bin"
    os.truncate(slab, 3 * CHUNK)  # slots 3 and 4 are gone
    with open(slab, "r+b") as f:  # and slot 1 holds a wrong byte
        f.seek(CHUNK + 77)
        b = f.read(1)
        f.seek(CHUNK + 77)
        f.write(bytes([b[0] ^ 1]))
    assert not load(tier, pool, keys, list(range(8, 13)), job_id=7)
    assert [mgr.lookup(k, CTX) for k in keys] == [LookupResult.HIT, LookupResult.MISS, LookupResult.HIT,
                                                  LookupResult.MISS, LookupResult.MISS]
    c = mgr.get_stats().counters
    assert c["checksum_failures"] == 1 and c["load_failures"] == 2, c
    assert load(tier, pool, [keys[0], keys[2]], [8, 9], job_id=8)
    np.testing.assert_array_equal(pool.chunk(9), expected(keys[2]))
