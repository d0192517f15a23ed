"""`kvoffload storage check`: finds every damage planted in a real storage
directory, changes nothing, and runs beside an engine holding it open."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

from kvoffload.cli import main
from kvoffload.tiers.storage.check import check
from storage_helpers import CHUNK, close, fill, key, store

RECORD = 128


@pytest.fixture
def stored(make_tier, pool, tmp_path):
    """A closed storage directory holding 6 chunks; returns its ns-* dir."""
    tier = make_tier(capacity_slots=16, num_files=2)
    keys = [key(i) for i in range(6)]
    for c, k in enumerate(keys):
        fill(pool, c, k)
    assert store(tier, pool, keys, list(range(6)))
    d = tier.store.dir
    close(tier)
    return d


def _flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


def _snapshot(d):
    return {f.name: (hashlib.sha256(f.read_bytes()).hexdigest(), f.stat().st_mtime_ns) for f in d.iterdir()}


def _run(capsys, d) -> tuple[int, str]:
    rc = main(["storage", "check", str(d)])
    return rc, capsys.readouterr().out


def test_clean_directory(stored, capsys):
    before = _snapshot(stored)
    rc, out = _run(capsys, stored.parent)
    assert rc == 0, out
    assert f"6 chunks, {6 * CHUNK:,} bytes, 0 bad records, 0 bad chunks" in out
    assert "model=test-model" in out and out.rstrip().endswith("ok")
    assert _snapshot(stored) == before  # read-only: not a byte, not an mtime


def test_flipped_chunk_byte(stored, capsys):
    (r,) = check(stored)
    slot = 3
    slab = stored / f"slab-{slot % 2}.bin"
    _flip(slab, (slot // 2) * CHUNK + 999)
    before = _snapshot(stored)
    rc, out = _run(capsys, stored)
    assert rc == 1 and "0 bad records, 1 bad chunk" in out and "DAMAGED" in out, out
    assert _snapshot(stored) == before


@pytest.mark.parametrize("record", [0, 2])
def test_flipped_index_record(stored, capsys, record):
    _flip(stored / "index.log", record * RECORD + 20)
    rc, out = _run(capsys, stored)
    # the header is not a chunk: all 6 still verified; a PUT's chunk is not counted
    chunks = 6 if record == 0 else 5
    assert rc == 1 and f"{chunks} chunks" in out and "1 bad record, 0 bad chunks" in out, out


def test_empty_namespace_json(stored, capsys):
    (stored / "namespace.json").write_bytes(b"")
    rc, out = _run(capsys, stored)
    assert rc == 1 and "damaged: namespace.json is empty" in out, out


def test_deleted_index_beside_slab_files_is_damage(stored, capsys):
    os.unlink(stored / "index.log")  # every chunk in the slabs is lost: reported, not "ok"
    rc, out = _run(capsys, stored)
    assert rc == 1 and "damaged: index.log is missing beside 2 slab files" in out, out


def test_missing_slab_file(stored, capsys):
    os.unlink(stored / "slab-1.bin")
    rc, out = _run(capsys, stored)
    assert rc == 1 and "slab-1.bin: No such file or directory" in out and "3 bad chunks" in out, out


def test_truncated_slab_file(stored, capsys):
    os.truncate(stored / "slab-0.bin", CHUNK)  # slots 2 and 4 lose their bytes
    rc, out = _run(capsys, stored)
    assert rc == 1 and "2 bad chunks" in out, out


def test_torn_tail_is_reported_not_damage(stored, capsys):
    with open(stored / "index.log", "ab") as f:
        f.write(b"\xff" * 50)
    rc, out = _run(capsys, stored)
    assert rc == 0 and "1 torn record at the end" in out, out


def test_not_a_storage_directory(tmp_path, capsys):
    assert main(["storage", "check", str(tmp_path)]) == 2
    assert "holds no storage namespace" in capsys.readouterr().err


def test_runs_beside_an_engine_holding_the_directory(make_tier, pool):
    tier = make_tier(capacity_slots=16)
    fill(pool, 0, key(1))
    assert store(tier, pool, [key(1)], [0])
    out = subprocess.run([sys.executable, "-m", "kvoffload.cli", "storage", "check", str(tier.store.dir.parent)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "1 chunk," in out.stdout, out
    fill(pool, 1, key(2))
    assert store(tier, pool, [key(2)], [1], job_id=2)  # the engine was not disturbed


NO_GEOMETRY = "index header damaged and the geometry cannot be inferred"


def _zero_header(d) -> None:
    with open(d / "index.log", "r+b") as f:
        f.write(bytes(RECORD))


def _set_chunk_bytes(d, value) -> None:
    meta = json.loads((d / "namespace.json").read_text())
    meta["chunk_bytes"] = value
    (d / "namespace.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("damage, line", [
    (lambda d: (d / "namespace.json").write_text("[" * 30000 + "]" * 30000), "namespace.json is damaged"),
    (lambda d: (os.unlink(d / "namespace.json"), os.mkdir(d / "namespace.json")),
     "namespace.json: not a regular file"),
    (lambda d: (os.unlink(d / "index.log"), os.mkdir(d / "index.log")), "index.log: not a regular file"),
    (lambda d: (_zero_header(d), _set_chunk_bytes(d, "x")), NO_GEOMETRY),
    (lambda d: (_zero_header(d), _set_chunk_bytes(d, 4096.5)), NO_GEOMETRY),
    (lambda d: (_zero_header(d), _set_chunk_bytes(d, 10**15)), NO_GEOMETRY),
], ids=["deep-json", "namespace-dir", "index-dir", "chunk-str", "chunk-float", "chunk-huge"])
def test_damaged_directory_is_a_report_not_a_traceback(stored, capsys, damage, line):
    damage(stored)
    rc, out = _run(capsys, stored.parent)  # a traceback would raise here
    assert rc == 1 and f"  damaged: {line}" in out and "DAMAGED (1 namespace)" in out, out


@pytest.mark.parametrize("name", ["namespace.json", "index.log", "slab-0.bin"])
def test_a_fifo_is_reported_not_waited_on(stored, name):
    """In a child with a time limit: opening a FIFO to read blocks until a writer comes."""
    os.unlink(stored / name)
    os.mkfifo(stored / name, 0o600)
    out = subprocess.run([sys.executable, "-m", "kvoffload.cli", "storage", "check", str(stored)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and f"  damaged: {name}: not a regular file" in out.stdout, out
    assert out.stderr == "", out
