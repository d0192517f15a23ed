"""The storage tier's persistent index: a log of fixed-size, self-checksummed
records saying which key a slot holds.

Crash safety rests on ordering, not on the log alone:
- a PUT (slot holds key, with the xxhash of its bytes) is appended only after
  the slot's bytes were made durable (fdatasync of the slab file), and
- before a slot that a durable PUT names is overwritten, a FREE for it is
  appended and made durable.
So after a kill -9 at any moment, every PUT the log holds (and no later FREE
cancels) names bytes that are on disk. An append is all or nothing: one a
full disk cuts short fails and is cut back to the last whole record, so no
store is acknowledged, and no slot overwritten, on a record not on disk.

Every record checks itself (its xxh64, seeded by the geometry), so a damaged
record is skipped and counted and the rest are kept: a lost PUT is a lost
key, a lost FREE leaves an old PUT whose checksum no longer matches the
slot's bytes (a miss on load). Bad records at the very end are a torn tail
(an append a crash interrupted, never acknowledged), not damage.

The log is read at open in bounded memory (fixed-size reads; the live map
never exceeds the slot count) and compacted (the live PUTs written to a new
file that atomically replaces the old one) at open and whenever it grows past
a small multiple of the live index, so it stays bounded over a long run.
"""

from __future__ import annotations

import errno
import os
import stat
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field

import xxhash

MAGIC = b"KVIX"
VERSION = 2  # in the header: records' checksums are seeded by the geometry
OP_HEADER, OP_PUT, OP_FREE = 0, 1, 2
MAX_KEY_BYTES = 100
# magic, op, key_len, version (header) / 0, slot, checksum, key (padded); then the record's own xxh64
_BODY = struct.Struct(f"<4sBBHIQ{MAX_KEY_BYTES}s")
_CRC = struct.Struct("<Q")
RECORD_BYTES = _BODY.size + _CRC.size
assert RECORD_BYTES == 128
READ_RECORDS = 8192  # per read at open (1 MiB): memory stays bounded whatever the log's size
# compact once the log holds more than 2 records per live entry plus this
# many (128 KiB): appends stay O(1) amortized, the log O(live index)
COMPACT_SLACK = 1024
_ZEROS = bytes(READ_RECORDS * RECORD_BYTES)
_O_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True)
class Geometry:
    """What the slots mean; a log written under another geometry is void."""

    namespace_digest: str
    slot_bytes: int
    num_files: int

    def header_key(self) -> bytes:
        return f"{self.namespace_digest}:{self.num_files}".encode()

    def seed(self) -> int:
        """Seeds every record's checksum: a record of another geometry fails it."""
        return xxhash.xxh64_intdigest(self.header_key() + self.slot_bytes.to_bytes(8, "little"))


def pack(op: int, slot: int, checksum: int, key: bytes, seed: int = 0, version: int = 0) -> bytes:
    body = _BODY.pack(MAGIC, op, len(key), version, slot, checksum, key)
    return body + _CRC.pack(xxhash.xxh64_intdigest(body, seed))


def unpack(rec, seed: int = 0) -> tuple[int, int, int, bytes, int] | None:
    """(op, slot, checksum, key, version), or None for a damaged or foreign record."""
    if len(rec) != RECORD_BYTES:
        return None
    body = rec[: _BODY.size]
    if _CRC.unpack_from(rec, _BODY.size)[0] != xxhash.xxh64_intdigest(body, seed):
        return None
    magic, op, key_len, version, slot, checksum, key = _BODY.unpack(body)
    if magic != MAGIC or op not in (OP_HEADER, OP_PUT, OP_FREE) or key_len > MAX_KEY_BYTES:
        return None
    return op, slot, checksum, bytes(key[:key_len]), version


def header(geometry: Geometry) -> bytes:
    # seed 0: any reader can tell which geometry (or format) a log is of
    return pack(OP_HEADER, 0, geometry.slot_bytes, geometry.header_key(), version=VERSION)


def read_header(fd: int) -> tuple[str, int, int] | None:
    """(namespace digest, num_files, slot_bytes) from a log's header, or None."""
    h = unpack(os.pread(fd, RECORD_BYTES, 0))
    if h is None or h[0] != OP_HEADER or h[4] != VERSION:
        return None
    digest, _, nf = h[3].decode(errors="replace").rpartition(":")
    return (digest, int(nf), h[2]) if nf.isdigit() else None


@dataclass
class Replayed:
    """What a log says: slot -> (key, checksum) in log order (oldest first)."""

    entries: dict[int, tuple[bytes, int]] = field(default_factory=dict)
    records: int = 0  # good records, header included
    bad_records: int = 0  # damaged records followed by good ones (or a damaged header)
    torn_tail: int = 0  # damaged records at the end: an interrupted append
    foreign: bool = False  # written under another geometry or format: ignored


def replay_fd(fd: int, geometry: Geometry, num_slots: int) -> Replayed:
    out = Replayed()
    size = os.fstat(fd).st_size
    if size == 0:
        return out
    first = unpack(os.pread(fd, RECORD_BYTES, 0))
    seed = geometry.seed()
    if first is not None and first[0] == OP_HEADER:
        if first[4] not in (0, VERSION) or first[3] != geometry.header_key() or first[2] != geometry.slot_bytes:
            out.foreign = True
            return out
        if first[4] == 0:  # written before records were seeded: read as then (the open rewrites it)
            seed = 0
        out.records = 1
    else:
        out.bad_records = 1  # a damaged header: the records still check themselves
    live = out.entries
    slot_of: dict[bytes, int] = {}
    pending_bad = 0  # bad records not yet followed by a good one
    off = RECORD_BYTES
    while off < size:
        data = os.pread(fd, READ_RECORDS * RECORD_BYTES, off)
        if not data:
            break
        off += len(data)
        if data == _ZEROS[: len(data)]:  # a hole (sparse file): no record, skip fast
            pending_bad += -(-len(data) // RECORD_BYTES)
            continue
        view = memoryview(data)
        for pos in range(0, len(data), RECORD_BYTES):
            rec = unpack(view[pos : pos + RECORD_BYTES], seed)
            if rec is None or rec[0] == OP_HEADER:
                pending_bad += 1
                continue
            out.bad_records += pending_bad
            pending_bad = 0
            out.records += 1
            op, slot, checksum, key, _ = rec
            if op == OP_PUT:
                old = slot_of.get(key)
                if old is not None and old != slot:
                    live.pop(old, None)  # a key lives in its newest slot only
                    del slot_of[key]
                prev = live.pop(slot, None)  # re-insert: dict order follows recency
                if prev is not None and slot_of.get(prev[0]) == slot:
                    del slot_of[prev[0]]
                if slot < num_slots:  # beyond the capacity: dropped, so memory stays bounded
                    live[slot] = (key, checksum)
                    slot_of[key] = slot
            else:
                entry = live.pop(slot, None)
                if entry is not None and slot_of.get(entry[0]) == slot:
                    del slot_of[entry[0]]
    out.torn_tail = pending_bad
    return out


def write_all(fd: int, data) -> None:
    """os.write until every byte is written: on a full disk Linux writes what
    fits and returns a short count, and only the next write raises ENOSPC."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:  # never for a regular file; do not spin on it
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view = view[n:]


def open_regular(name: str, dir_fd: int, flags: int = 0) -> int:
    """O_RDONLY descriptor of dir/name, refused (OSError naming it) unless a
    regular file: O_NONBLOCK so a FIFO planted there cannot hang the open."""
    fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC | flags, dir_fd=dir_fd)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file: refusing it", name)
    return fd


def write_atomically(dir_fd: int, name: str, chunks: Iterable[bytes]) -> None:
    """Replace dir/name with the given bytes: a new file created exclusively
    (never through a link), fsync'd, renamed over the old one, then the
    directory fsync'd so the rename survives a crash."""
    tmp = name + ".tmp"
    try:
        os.unlink(tmp, dir_fd=dir_fd)  # left by a crash; unlinking a link removes the link only
    except FileNotFoundError:
        pass
    fd = os.open(tmp, _O_NEW, 0o600, dir_fd=dir_fd)
    try:
        try:
            for chunk in chunks:
                write_all(fd, chunk)
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        try:  # give back the space it took (a full disk is the likely cause)
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise
    os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    os.fsync(dir_fd)


class IndexLog:
    """The open log of one storage directory: replayed and compacted on open,
    then appended to. Not thread-safe: SlabStore serializes its calls."""

    NAME = "index.log"

    def __init__(self, dir_fd: int, geometry: Geometry, num_slots: int):
        self.dir_fd = dir_fd
        self.geometry = geometry
        self._seed = geometry.seed()
        self._fd = -1
        # the file may disagree with what the caller holds as durable (an
        # append that failed and could not be cut back, or a reset that voided
        # it): the caller rewrites it before the next append
        self.dirty = False
        try:
            fd = open_regular(self.NAME, dir_fd)
        except FileNotFoundError:
            found = Replayed()
        else:
            try:
                found = replay_fd(fd, geometry, num_slots)
            except OSError as e:  # name the file: pread errors carry no name
                raise OSError(e.errno, e.strerror, self.NAME) from None
            finally:
                os.close(fd)
        self.entries = found.entries
        self.bad_records = found.bad_records
        self.records = 0  # in the file now
        self.rewrite(list(self.entries.items()))

    def pack(self, op: int, slot: int, checksum: int = 0, key: bytes = b"") -> bytes:
        return pack(op, slot, checksum, key, self._seed)

    def rewrite(self, entries: list[tuple[int, tuple[bytes, int]]]) -> None:
        """Atomically replace the log with a header plus the given PUTs."""
        def chunks():
            yield header(self.geometry)
            for i in range(0, len(entries), READ_RECORDS):
                yield b"".join(self.pack(OP_PUT, s, c, k) for s, (k, c) in entries[i : i + READ_RECORDS])

        write_atomically(self.dir_fd, self.NAME, chunks())
        try:
            fd = os.open(self.NAME, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.dir_fd)
        except OSError:  # never append to the replaced file: reopen at the next append
            self.close()
            self.dirty = True
            raise
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = fd
        self.records = 1 + len(entries)
        self.dirty = False

    def append(self, records: bytes) -> None:
        """Append packed records and make them durable before returning. If
        that fails (a full disk takes part of them), the file is cut back to
        its last good record, so a failed commit leaves no record behind; if
        even that fails, the log is marked dirty."""
        try:
            write_all(self._fd, records)
            os.fdatasync(self._fd)
        except OSError:
            try:  # shrinking needs no free space
                os.ftruncate(self._fd, self.records * RECORD_BYTES)
                os.fsync(self._fd)
            except OSError:
                self.dirty = True
            raise
        self.records += len(records) // RECORD_BYTES

    def void(self) -> None:
        """Durably drop every record but the header, needing no free space
        (a cache reset on a full disk)."""
        try:
            os.ftruncate(self._fd, RECORD_BYTES)
            os.fsync(self._fd)
        except OSError:
            self.dirty = True
            raise
        self.records = 1

    def needs_compaction(self, live: int, appending: int = 0) -> bool:
        """Whether the log, with `appending` more records, outgrows `live` entries."""
        return self.records + appending > 2 * live + COMPACT_SLACK

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
