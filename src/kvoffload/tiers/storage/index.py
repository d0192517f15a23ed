"""The storage tier's persistent index: an append-only log of fixed-size,
self-checksummed records saying which key a slot holds.

Crash safety rests on ordering, not on the log alone:
- a PUT (slot holds key, with the xxhash of its bytes) is appended only after
  the slot's bytes were made durable (fdatasync of the slab file), and
- before a slot that a durable PUT names is overwritten, a FREE for it is
  appended and made durable.
So after a kill -9 at any moment, every PUT the log holds (and no later FREE
cancels) names bytes that are on disk. A torn last record fails its record
checksum and ends the replay. On open the log is compacted: the live PUTs are
written to a new file that atomically replaces the old one.
"""

from __future__ import annotations

import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import xxhash

MAGIC = b"KVIX"
OP_HEADER, OP_PUT, OP_FREE = 0, 1, 2
MAX_KEY_BYTES = 100
# magic, op, key_len, reserved, slot, checksum, key (padded); then the record's own xxh64
_BODY = struct.Struct(f"<4sBBHIQ{MAX_KEY_BYTES}s")
_CRC = struct.Struct("<Q")
RECORD_BYTES = _BODY.size + _CRC.size
assert RECORD_BYTES == 128


@dataclass(frozen=True)
class Geometry:
    """What the slots mean; a log written under another geometry is void."""

    namespace_digest: str
    slot_bytes: int
    num_files: int

    def header_key(self) -> bytes:
        return f"{self.namespace_digest}:{self.num_files}".encode()


def pack(op: int, slot: int, checksum: int, key: bytes) -> bytes:
    body = _BODY.pack(MAGIC, op, len(key), 0, slot, checksum, key)
    return body + _CRC.pack(xxhash.xxh64_intdigest(body))


def unpack(rec: bytes) -> tuple[int, int, int, bytes] | None:
    """(op, slot, checksum, key), or None for a torn or foreign record."""
    body = rec[: _BODY.size]
    if len(rec) != RECORD_BYTES or _CRC.unpack(rec[_BODY.size :])[0] != xxhash.xxh64_intdigest(body):
        return None
    magic, op, key_len, _, slot, checksum, key = _BODY.unpack(body)
    if magic != MAGIC or op not in (OP_HEADER, OP_PUT, OP_FREE) or key_len > MAX_KEY_BYTES:
        return None
    return op, slot, checksum, key[:key_len]


def replay(path: Path, geometry: Geometry, num_slots: int) -> dict[int, tuple[bytes, int]]:
    """slot -> (key, checksum) for every live entry of the log at path, in
    log order (oldest first). A missing log, or one of another geometry, is empty."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return {}
    first = unpack(data[:RECORD_BYTES])
    if first is None or first[0] != OP_HEADER or first[3] != geometry.header_key() \
            or first[2] != geometry.slot_bytes:
        return {}
    live: dict[int, tuple[bytes, int]] = {}
    slot_of: dict[bytes, int] = {}
    for off in range(RECORD_BYTES, len(data) - RECORD_BYTES + 1, RECORD_BYTES):
        rec = unpack(data[off : off + RECORD_BYTES])
        if rec is None:
            break  # torn tail: nothing after it was acknowledged
        op, slot, checksum, key = rec
        if op == OP_PUT:
            live.pop(slot, None)  # re-insert: dict order follows recency
            live[slot] = (key, checksum)
            old = slot_of.get(key)
            if old is not None and old != slot:
                live.pop(old, None)  # a key lives in its newest slot only
            slot_of[key] = slot
        elif op == OP_FREE:
            entry = live.pop(slot, None)
            if entry is not None and slot_of.get(entry[0]) == slot:
                del slot_of[entry[0]]
    return {s: e for s, e in live.items() if s < num_slots}


class IndexLog:
    """The open log: compacted on open, then appended to (thread-safe)."""

    def __init__(self, path: Path, geometry: Geometry, num_slots: int):
        self.path = path
        self.geometry = geometry
        self.entries = replay(path, geometry, num_slots)
        self._lock = threading.Lock()
        self._fd = -1
        self._rewrite(self.entries)

    def _rewrite(self, entries: dict[int, tuple[bytes, int]]) -> None:
        """Atomically replace the log with a header plus the given PUTs."""
        tmp = self.path.with_suffix(".tmp")
        blob = bytearray(pack(OP_HEADER, 0, self.geometry.slot_bytes, self.geometry.header_key()))
        for slot, (key, checksum) in entries.items():
            blob += pack(OP_PUT, slot, checksum, key)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, blob)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        dfd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)  # the rename itself must survive a crash
        finally:
            os.close(dfd)
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)

    def append(self, records: bytes) -> None:
        """Append packed records and make them durable before returning."""
        with self._lock:
            os.write(self._fd, records)
            os.fdatasync(self._fd)

    def clear(self) -> None:
        self._rewrite({})

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
