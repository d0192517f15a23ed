"""The index log on real files: bounded over a long stream, read at open in
bounded memory, and a damaged record costs that record only."""

from __future__ import annotations

import os
import tracemalloc

import numpy as np
import pytest

from kvoffload.abstractions import LookupResult
from kvoffload.tiers.storage.tier import StorageTier
from storage_helpers import CTX, close, expected, fill, key, load, store

RECORD = 128  # bytes per index record


def _stream(tier: StorageTier, n: int, batch: int = 8) -> None:
    """n stores into a full tier through the index API, as the worker records
    them (each overwriting a slot), with a group commit after each batch."""
    s = tier.store
    for b in range(0, n, batch):
        slots = [(b + j) % s.num_slots for j in range(batch)]
        s.record_stored([(slot, key(b + j), b + j) for j, slot in enumerate(slots)])
        assert s.flush()


def test_log_stays_bounded_over_a_long_stream(make_tier):
    tier = make_tier(capacity_slots=32)
    _stream(tier, 6000)  # 6,000 records appended: 750 KiB if never compacted
    log = tier.store.dir / "index.log"
    live = dict(tier.store.durable)
    assert len(live) == 32
    # a small multiple of the live index (32 records) plus a fixed slack
    assert log.stat().st_size <= 2048 * RECORD
    close(tier)
    again = make_tier(capacity_slots=32)
    assert again.store.durable == live  # compaction kept every live entry
    assert again.store.bad_index_records == 0


def test_open_reads_a_huge_log_in_bounded_memory(make_tier):
    tier = make_tier()
    path = tier.store.dir / "index.log"
    close(tier)
    with open(path, "r+b") as f:  # a valid header, then 1 GiB of hole
        f.truncate(RECORD + (1 << 30))
    tracemalloc.start()
    try:
        again = make_tier()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak
    assert path.stat().st_size == RECORD  # compacted back to its header
    assert again.store.bad_index_records == 0  # a trailing hole is a torn tail, not damage


@pytest.mark.parametrize("record", [0, 1, 10, 30])
def test_a_flipped_bit_costs_one_record(make_tier, pool, record):
    """48 PUTs after the header; a flip in record 0 (the header) keeps all
    48, elsewhere 47, and everything kept still reads back its own bytes."""
    tier = make_tier(capacity_slots=64)
    keys = [key(i) for i in range(48)]
    for b in range(0, 48, 8):  # 6 jobs of 8: 6 appends
        for c, k in enumerate(keys[b : b + 8]):
            fill(pool, c, k)
        assert store(tier, pool, keys[b : b + 8], list(range(8)), job_id=b + 1)
    path = tier.store.dir / "index.log"
    close(tier)
    assert path.stat().st_size == 49 * RECORD
    with open(path, "r+b") as f:
        f.seek(record * RECORD + 37)
        b = f.read(1)
        f.seek(record * RECORD + 37)
        f.write(bytes([b[0] ^ 0x10]))
    again = make_tier(capacity_slots=64)
    mgr = again.get_manager()
    hits = [k for k in keys if mgr.lookup(k, CTX) is LookupResult.HIT]
    assert len(hits) == (48 if record == 0 else 47)
    if record:
        assert keys[record - 1] not in hits  # the PUT that was hit
    assert mgr.get_stats().counters["index_bad_records"] == 1
    for b in range(0, len(hits), 8):
        part = hits[b : b + 8]
        assert load(again, pool, part, list(range(len(part))), job_id=100 + b)
        for c, k in enumerate(part):
            np.testing.assert_array_equal(pool.chunk(c), expected(k))
    close(again)
    third = make_tier(capacity_slots=64)  # the compaction at open kept them
    assert sum(third.get_manager().lookup(k, CTX) is LookupResult.HIT for k in keys) == len(hits)


def test_log_of_another_geometry_is_ignored_not_counted(make_tier, pool):
    tier = make_tier(num_files=4)
    fill(pool, 0, key(1))
    assert store(tier, pool, [key(1)], [0])
    close(tier)
    other = make_tier(num_files=2)  # slots map to other offsets now: nothing may be served
    assert other.get_manager().lookup(key(1), CTX) is LookupResult.MISS
    assert other.store.bad_index_records == 0


def test_a_torn_tail_is_dropped_not_counted(make_tier, pool):
    tier = make_tier()
    fill(pool, 0, key(1))
    assert store(tier, pool, [key(1)], [0])
    path = tier.store.dir / "index.log"
    close(tier)
    with open(path, "ab") as f:
        f.write(os.urandom(RECORD + 40))  # an append a crash cut short
    again = make_tier()
    assert again.get_manager().lookup(key(1), CTX) is LookupResult.HIT
    assert again.store.bad_index_records == 0


def test_a_log_of_the_previous_format_is_still_served(make_tier, pool):
    """Logs written before records were seeded by the geometry (header
    version 0) are read as they were written, then rewritten."""
    from kvoffload.tiers.storage.index import OP_HEADER, OP_PUT, pack, read_header

    tier = make_tier()
    fill(pool, 0, key(1))
    assert store(tier, pool, [key(1)], [0])
    s = tier.store
    (slot, (k, checksum)), = s.durable.items()
    g = s.index.geometry
    path = s.dir / "index.log"
    close(tier)
    path.write_bytes(pack(OP_HEADER, 0, g.slot_bytes, g.header_key()) + pack(OP_PUT, slot, checksum, k))
    again = make_tier()
    assert again.get_manager().lookup(key(1), CTX) is LookupResult.HIT
    assert load(again, pool, [key(1)], [3])
    np.testing.assert_array_equal(pool.chunk(3), expected(key(1)))
    close(again)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert read_header(fd) is not None  # rewritten in the new format
    finally:
        os.close(fd)
    assert make_tier().get_manager().lookup(key(1), CTX) is LookupResult.HIT
