"""The storage directory's safety checks: the directory is opened once
(O_NOFOLLOW) and refused unless this user owns it and nobody else can write
it; a file in it is refused unless a regular file of this user with one
link. Plus making the missing directories and undoing what an open made."""

from __future__ import annotations

import errno
import os
import stat
import threading
from pathlib import Path

from kvoffload.config import ConfigError

_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
# (st_dev, st_ino) of the directories open in this process: a second opener
# here is told that, not "another process"
_OPEN: set[tuple[int, int]] = set()
_OPEN_LOCK = threading.Lock()


class StorageError(ConfigError):
    """The storage directory cannot be used (named in the message)."""


def refuse_unless_own(path: Path, st: os.stat_result) -> None:
    """StorageError unless st is a regular file of this user with one link:
    another user's file, or a second name of one of ours, would be written
    through (or trusted) behind its owner's back."""
    uid = os.geteuid()
    if stat.S_ISLNK(st.st_mode):
        raise StorageError(f"{path} is a symbolic link: refusing to follow it")
    if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
        raise StorageError(f"{path} is not a regular file of this user (uid {uid}): refusing it")
    if st.st_nlink != 1:
        raise StorageError(f"{path} has {st.st_nlink} hard links (another name would be written through): "
                           "refusing it; remove the other names or this directory")


def open_dir(path: Path) -> int:
    """An O_NOFOLLOW descriptor of a storage directory this user owns and
    nobody else can write; StorageError (one line) otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(path):
            raise StorageError(f"storage directory {path} is a symbolic link: refusing it "
                               "(point path at the real directory)") from None
        raise
    st = os.fstat(fd)
    uid = os.geteuid()
    if st.st_uid != uid:
        os.close(fd)
        raise StorageError(f"storage directory {path} belongs to uid {st.st_uid}, not to this "
                           f"process (uid {uid}): refusing it, another user could have planted "
                           "links there; remove it or choose another path")
    if st.st_mode & 0o022:
        os.close(fd)
        raise StorageError(f"storage directory {path} is writable by others (mode "
                           f"{stat.S_IMODE(st.st_mode):04o}): refusing it; `chmod go-w` it or remove it")
    return fd


def make_dirs(d: Path) -> list[Path]:
    """Make d and its missing parents (d itself 0700); the ones made, outermost first."""
    missing, made = [], []
    p = d
    while not os.path.lexists(p):
        missing.append(p)
        p = p.parent
    for m in reversed(missing):
        try:
            os.mkdir(m, 0o700 if m == d else 0o777)
        except FileExistsError:
            continue
        made.append(m)
    return made


def remove_made(dfd: int, made: list[str], grown: dict[str, int]) -> None:
    """Undo an open: shrink the files it grew back to their sizes, remove the ones it made."""
    for name, size in grown.items():
        try:
            fd = os.open(name, os.O_WRONLY | _NOFOLLOW, dir_fd=dfd)
            try:
                os.ftruncate(fd, size)
            finally:
                os.close(fd)
        except OSError:
            pass
    for name in made:
        try:
            os.unlink(name, dir_fd=dfd)
        except OSError:
            pass
