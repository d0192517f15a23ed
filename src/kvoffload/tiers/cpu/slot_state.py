"""The CPU tier's per-slot state: one byte per slot (manager.py), in a
bytearray (indexing it key by key costs what a list's does) that numpy also
sees, so a whole call's pins change in a few array operations.

    0           readable, evictable
    1..254      readable, pinned by that many loads in flight (a pin past
                254 is counted in a dict beside: `more`)
    255         being written (PENDING): not readable, not evictable
"""

from __future__ import annotations

import numpy as np

PENDING = 255
MAX_PINS = 254  # pins one byte counts; the rest go to `more`
VECTOR_MIN = 256  # keys per call from which pins go through numpy (below: the loop is as fast or faster; 64: 1.8x slower)


def pin_all(st: np.ndarray, mark: np.ndarray, idx: np.ndarray) -> int | None:
    """Pin every slot of idx at once; how many were unpinned before. None,
    with nothing changed, if one is pending or at MAX_PINS or a slot is
    listed twice: the caller then pins key by key."""
    v = st[idx]
    if v.max() >= MAX_PINS or _listed_twice(mark, idx):
        return None
    st[idx] = v + 1
    return len(idx) - int(np.count_nonzero(v))


def unpin_all(st: np.ndarray, mark: np.ndarray, idx: np.ndarray) -> int | None:
    """Drop one pin of every slot of idx at once; how many became unpinned.
    None, with nothing changed, if one is not pinned, pending or at
    MAX_PINS, or a slot is listed twice: the caller then goes key by key."""
    v = st[idx]
    if v.min() == 0 or v.max() >= MAX_PINS or _listed_twice(mark, idx):
        return None
    st[idx] = v - 1
    return int(np.count_nonzero(v == 1))


def _listed_twice(mark: np.ndarray, idx: np.ndarray) -> bool:
    # each position writes its index at its slot; a slot listed twice keeps one
    if len(idx) > len(mark):
        return True
    pos = np.arange(len(idx))
    mark[idx] = pos
    return bool((mark[idx] != pos).any())
