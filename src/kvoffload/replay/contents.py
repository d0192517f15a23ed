"""Block contents of a replay, and the byte checks of every load.

A block's bytes are a pure function of its hash: int64 word i of a block
with seed s holds s + i * golden, cheap to write and to check, and different
for every block and offset. The prefill writes every byte of a computed
block; stores and loads copy every byte.

A load is checked in one of two ways (`verify`):
- "sample" (the default): every loaded block, SAMPLE_WORDS of its 8-byte
  words: the first, the last, and words spread evenly between them at an
  offset that moves from one load to the next. A block in the wrong slot,
  stale, never written, or copied only in part differs in every one of its
  words or at its ends, so a sample catches it; a flipped byte in the
  middle of one block is caught only when the sample covers it.
- "all": every byte of every loaded block (costs a pass over all loaded
  bytes: most of a replay's harness time at small blocks).
"""

from __future__ import annotations

import numpy as np

from kvoffload.config import ConfigError

_GOLDEN = np.int64(-7046029254386353131)  # 0x9E3779B97F4A7C15 as int64
VERIFY_MODES = ("sample", "all")
SAMPLE_WORDS = 8


def seeds_of(hashes) -> np.ndarray:
    """A block's seed is its 64-bit hash, as int64."""
    return np.array(hashes, dtype=np.uint64).view(np.int64)


class BlockContents:
    """Writes and checks block contents in `words`, an int64 view
    (blocks, page_bytes // 8) of the simulated GPU's KV tensor."""

    def __init__(self, words: np.ndarray, verify: str = "sample"):
        if verify not in VERIFY_MODES:
            raise ConfigError(f"verify must be one of {', '.join(VERIFY_MODES)}, got {verify!r}")
        self.words = words
        self.verify = verify
        n = words.shape[1]
        self._base = np.arange(n, dtype=np.int64) * _GOLDEN
        self._loads = 0
        # Sampling a block of few words would check nearly all of it anyway.
        self._sampled = verify == "sample" and n > SAMPLE_WORDS
        self._step = max(1, (n - 2) // (SAMPLE_WORDS - 2)) if self._sampled else 1

    def fill(self, slots: np.ndarray, seeds: np.ndarray) -> None:
        """Write each block's contents (a simulated prefill): every byte."""
        n = len(slots)
        if not n:
            return
        a = _stretch(slots)
        if a is not None:
            np.add(self._base, seeds[:, None], out=self.words[a:a + n])  # one stretch: in place
        else:
            self.words[slots] = self._base + seeds[:, None]

    def check(self, slots: np.ndarray, seeds: np.ndarray) -> np.ndarray:
        """Indices (into slots) of loaded blocks whose bytes are not what
        they must be: every byte ("all") or a sample of every block."""
        if not len(slots):
            return np.empty(0, dtype=np.int64)
        if not self._sampled:
            got, want = self.words[slots], self._base + seeds[:, None]
        else:
            n = self.words.shape[1]
            self._loads += 1
            middle = 1 + (self._loads * 7919 + np.arange(SAMPLE_WORDS - 2) * self._step) % (n - 2)
            idx = np.concatenate(([0, n - 1], middle))
            a = _stretch(slots)
            if a is not None:  # one stretch of rows (the usual case): a column gather over them
                got = self.words[a:a + len(slots)].take(idx, axis=1)
            else:
                got = self.words.reshape(-1).take(slots[:, None] * n + idx[None, :])  # one flat gather
            want = self._base[idx][None, :] + seeds[:, None]
        if np.array_equal(got, want):  # one pass: every block matches (the usual case)
            return np.empty(0, dtype=np.int64)
        return np.flatnonzero(~(got == want).all(axis=1))

    def words_checked(self, blocks: int) -> int:
        """Words the checks of `blocks` loaded blocks compare."""
        return blocks * (SAMPLE_WORDS if self._sampled else self.words.shape[1])


def _stretch(slots: np.ndarray) -> int | None:
    """The first slot if slots are one ascending stretch (a, a+1, ...), else None."""
    n = len(slots)
    a = int(slots[0])
    if int(slots[-1]) == a + n - 1 and (n < 3 or (np.diff(slots) == 1).all()):
        return a
    return None
