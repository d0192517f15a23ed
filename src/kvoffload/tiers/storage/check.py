"""`kvoffload storage check DIR`: verify a storage directory, read-only.

DIR is a storage tier's `path` (holding ns-<digest>/ directories) or one
ns-<digest>/ directory. For each namespace it replays the index the way the
tier does at open, reads every live chunk and checks its xxhash, and prints
namespaces, chunks, bytes, bad records and bad chunks. Exit code 0: clean;
1: damage found; 2: not a storage directory.

It never writes (every file is opened O_RDONLY, never through a link) and
takes no lock, so it can run beside an engine that has the directory open
(a lock, even a shared one, would stop that engine from starting). A chunk
the engine rewrites during the check can look bad: each bad chunk is
re-checked against a fresh read of the index, and counted only if the index
still names the same bytes.
"""

from __future__ import annotations

import json
import mmap
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from kvoffload.align import align_up
from kvoffload.tiers.base import Namespace
from kvoffload.tiers.storage.index import Geometry, IndexLog, open_regular, read_header, replay_fd


@dataclass
class Report:
    dir: Path
    namespace: dict | None = None
    chunks: int = 0
    bytes: int = 0
    bad_records: int = 0
    bad_chunks: int = 0
    torn_tail: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def damaged(self) -> bool:
        return bool(self.bad_records or self.bad_chunks or self.problems)


def _why(e: OSError) -> str:
    return e.strerror or os.strerror(e.errno or 0)


def _read_namespace(dfd: int, rep: Report, digest: str) -> Namespace | None:
    """The namespace, if namespace.json holds this directory's (else None:
    nothing in it, chunk_bytes included, can be trusted)."""
    try:
        with os.fdopen(open_regular("namespace.json", dfd), "rb") as f:
            raw = f.read(1 << 16)
    except OSError as e:
        rep.problems.append(f"namespace.json: {_why(e)}")
        return None
    try:
        got = json.loads(raw)
        ns = Namespace(**got)
    except (ValueError, TypeError, RecursionError):  # RecursionError: arrays nested thousands deep
        rep.problems.append("namespace.json is " + ("empty" if not raw.strip() else "damaged"))
        return None
    rep.namespace = got
    if ns.digest() != digest:
        rep.problems.append(f"namespace.json describes namespace {ns.digest()}, not {digest}")
        return None
    return ns


def _slab_fds(dfd: int, num_files: int, rep: Report) -> list[int | None]:
    fds: list[int | None] = []
    for i in range(num_files):
        try:
            fds.append(open_regular(f"slab-{i}.bin", dfd, os.O_DIRECT))
        except OSError:
            try:  # no O_DIRECT here (tmpfs): buffered
                fds.append(open_regular(f"slab-{i}.bin", dfd))
            except OSError as e:
                rep.problems.append(f"slab-{i}.bin: {_why(e)}")
                fds.append(None)
    return fds


def check_namespace_dir(d: Path) -> Report:
    rep = Report(d)
    digest = d.name[len("ns-"):]
    try:
        dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        rep.problems.append(f"cannot open: {os.strerror(e.errno or 0)}")
        return rep
    try:
        ns = _read_namespace(dfd, rep, digest)
        try:
            ifd = open_regular(IndexLog.NAME, dfd)
        except FileNotFoundError:
            slabs = sorted(n for n in os.listdir(dfd) if n.startswith("slab-") and n.endswith(".bin"))
            if slabs:  # the tier writes the index before any slab file: it was lost or deleted
                rep.problems.append(f"{IndexLog.NAME} is missing beside {_plural(len(slabs), 'slab file')}: "
                                    "every chunk in them is lost (misses)")
            return rep  # else: created, never stored to: empty
        except OSError as e:
            rep.problems.append(f"{IndexLog.NAME}: {_why(e)}")
            return rep
        try:
            found = read_header(ifd)
            if found is not None and found[0] != digest:
                rep.problems.append(f"{IndexLog.NAME} belongs to namespace {found[0]}")
                return rep
            if found is not None:
                num_files, slot_bytes = found[1], found[2]
            else:  # damaged header: the geometry the tier would have used
                num_files = sum(1 for n in os.listdir(dfd) if n.startswith("slab-") and n.endswith(".bin"))
                cb = ns.chunk_bytes if ns else None
                slot_bytes = align_up(cb) if type(cb) is int and cb > 0 else 0
            if not num_files or not slot_bytes:
                rep.bad_records = 1
                rep.problems.append("index header damaged and the geometry cannot be inferred")
                return rep
            geometry = Geometry(digest, slot_bytes, num_files)
            replayed = replay_fd(ifd, geometry, 1 << 62)
            if replayed.foreign:
                rep.problems.append(f"{IndexLog.NAME} was written by another version or geometry")
                return rep
            rep.bad_records, rep.torn_tail = replayed.bad_records, replayed.torn_tail
            fds = _slab_fds(dfd, num_files, rep)
            try:
                bad = _verify(replayed.entries, fds, geometry)
                if bad:  # the engine may have rewritten them meanwhile: ask the index again
                    now = replay_fd(ifd, geometry, 1 << 62).entries
                    bad = _verify({s: now[s] for s in bad if now.get(s) == replayed.entries[s]}, fds, geometry)
            finally:
                for fd in fds:
                    if fd is not None:
                        os.close(fd)
            rep.chunks = len(replayed.entries)
            rep.bytes = rep.chunks * slot_bytes
            rep.bad_chunks = len(bad)
        finally:
            os.close(ifd)
    finally:
        os.close(dfd)
    return rep


def _verify(entries: dict[int, tuple[bytes, int]], fds: list[int | None], g: Geometry) -> list[int]:
    """Slots whose bytes do not match their index checksum (or cannot be read)."""
    buf = mmap.mmap(-1, g.slot_bytes)  # page-aligned, as O_DIRECT needs
    try:
        bad = []
        for slot, (_, checksum) in entries.items():
            fd = fds[slot % g.num_files]
            try:
                ok = fd is not None and os.preadv(fd, [buf], (slot // g.num_files) * g.slot_bytes) == g.slot_bytes \
                    and xxhash.xxh3_64_intdigest(buf) == checksum
            except OSError:
                ok = False
            if not ok:
                bad.append(slot)
        return bad
    finally:
        buf.close()


def check(path: Path) -> list[Report] | None:
    """A report per namespace directory, or None if path holds none."""
    path = Path(path)
    if path.name.startswith("ns-") and path.is_dir():
        dirs = [path]
    elif path.is_dir():
        dirs = sorted(p for p in path.iterdir() if p.name.startswith("ns-") and not p.is_symlink() and p.is_dir())
    else:
        return None
    return [_check_safely(d) for d in dirs] or None


def _check_safely(d: Path) -> Report:
    """A damaged directory is a report, never a traceback (whatever the damage
    the checks above did not foresee)."""
    try:
        return check_namespace_dir(d)
    except (OSError, ValueError, TypeError, OverflowError, MemoryError, RecursionError) as e:
        rep = Report(d)
        rep.problems.append(f"cannot be checked: {e}")
        return rep


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def format_report(r: Report) -> str:
    ns = r.namespace or {}
    what = " ".join(f"{k}={ns[k]}" for k in ("model", "dtype", "block_size", "parallel_layout") if k in ns)
    line = (f"{r.dir}: {what or '(namespace unknown)'}: {_plural(r.chunks, 'chunk')}, {r.bytes:,} bytes, "
            f"{_plural(r.bad_records, 'bad record')}, {_plural(r.bad_chunks, 'bad chunk')}")
    if r.torn_tail:
        line += f" ({_plural(r.torn_tail, 'torn record')} at the end: an interrupted append, harmless)"
    return "\n".join([line, *(f"  damaged: {p}" for p in r.problems)])


def run(args) -> int:
    try:
        reports = check(args.dir)
    except OSError as e:  # e.g. DIR not readable
        print(f"kvoffload storage check: {args.dir}: {_why(e)}", file=sys.stderr)
        return 2
    if reports is None:
        print(f"kvoffload storage check: {args.dir} holds no storage namespace (ns-*/)", file=sys.stderr)
        return 2
    for r in reports:
        print(format_report(r))
    damaged = sum(r.damaged for r in reports)
    print(f"total: {_plural(len(reports), 'namespace')}, {_plural(sum(r.chunks for r in reports), 'chunk')}, "
          f"{sum(r.bytes for r in reports):,} bytes, {_plural(sum(r.bad_records for r in reports), 'bad record')}, "
          f"{_plural(sum(r.bad_chunks for r in reports), 'bad chunk')}: "
          + (f"DAMAGED ({_plural(damaged, 'namespace')})" if damaged else "ok"))
    return 1 if damaged else 0


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("storage")  # its help line: kvoffload.cli.COMMANDS
    p.set_defaults(func=lambda args: p.print_help() or 2)
    sub = p.add_subparsers(dest="storage_command", metavar="ACTION")
    c = sub.add_parser("check", help="verify every chunk's checksum, read-only (safe beside a running engine)")
    c.add_argument("dir", type=Path, help="the storage tier's path, or one ns-<digest> directory in it")
    c.set_defaults(func=run)
