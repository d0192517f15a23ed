"""The simulated GPU side of a replay: a KV tensor of block slots, the GPU
prefix cache over it, and block contents that are a pure function of the
block hash (so every load can be checked byte for byte).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

_GOLDEN = np.int64(-7046029254386353131)  # 0x9E3779B97F4A7C15 as int64


class GPUBlocks:
    """num_blocks slots of page_bytes on a plain CPU tensor (the "GPU").

    Slots in use by running requests are refcounted; a released slot with a
    hash stays cached (idle) for later prefix hits, at most `cache_blocks`
    of them, least recently used evicted first.
    """

    def __init__(self, num_blocks: int, page_bytes: int, cache_blocks: int):
        if page_bytes % 8:
            raise ValueError(f"GPU page size must be a multiple of 8 bytes, got {page_bytes}")
        self.tensor = torch.zeros((num_blocks, page_bytes), dtype=torch.uint8)
        self.words = self.tensor.numpy().view(np.int64)  # (num_blocks, page_bytes // 8)
        self.cache_blocks = cache_blocks
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.slot_of: dict[int, int] = {}  # block hash -> slot (in use or idle)
        self.hash_of: list[int | None] = [None] * num_blocks
        self.refs = [0] * num_blocks
        self.idle: OrderedDict[int, int] = OrderedDict()  # hash -> slot, least recent first
        self.evictions = 0
        # Word i of a block with seed s holds s + i * golden: cheap to make
        # and to check, and different for every block and offset.
        self._base = np.arange(page_bytes // 8, dtype=np.int64) * _GOLDEN

    # ---- prefix cache -------------------------------------------------------

    def match(self, hashes: list[int]) -> int:
        """Length of the leading run of hashes cached on the GPU."""
        n = 0
        slot_of = self.slot_of
        for h in hashes:
            if h not in slot_of:
                break
            n += 1
        return n

    def acquire(self, hashes: list[int]) -> list[int]:
        """Take a reference on cached blocks (a GPU prefix hit)."""
        slots = []
        for h in hashes:
            s = self.slot_of[h]
            if self.refs[s] == 0:
                del self.idle[h]
            self.refs[s] += 1
            slots.append(s)
        return slots

    def allocate(self, n: int) -> list[int] | None:
        """n fresh slots, evicting idle cached blocks if needed; None if the
        running requests hold too many."""
        while len(self.free) < n and self.idle:
            h, s = self.idle.popitem(last=False)
            del self.slot_of[h]
            self.hash_of[s] = None
            self.free.append(s)
            self.evictions += 1
        if len(self.free) < n:
            return None
        slots = self.free[len(self.free) - n:]
        del self.free[len(self.free) - n:]
        for s in slots:
            self.refs[s] = 1
        return slots

    def register(self, slots: list[int], hashes: list[int]) -> None:
        """Computed or loaded blocks become prefix-cache hits."""
        for s, h in zip(slots, hashes):
            if h not in self.slot_of and self.hash_of[s] is None:
                self.slot_of[h] = s
                self.hash_of[s] = h

    def release(self, slots: list[int]) -> None:
        idle, refs, cap = self.idle, self.refs, self.cache_blocks
        for s in slots:
            refs[s] -= 1
            if refs[s]:
                continue
            h = self.hash_of[s]
            if h is None:
                self.free.append(s)
                continue
            if not cap:  # no prefix cache: the slot is simply free again
                del self.slot_of[h]
                self.hash_of[s] = None
                self.free.append(s)
                continue
            idle[h] = s
            if len(idle) > cap:
                h2, s2 = idle.popitem(last=False)
                del self.slot_of[h2]
                self.hash_of[s2] = None
                self.free.append(s2)
                self.evictions += 1

    # ---- contents -----------------------------------------------------------

    def fill(self, slots: np.ndarray, seeds: np.ndarray) -> None:
        """Write each block's deterministic contents (a simulated prefill)."""
        if len(slots):
            self.words[slots] = self._base + seeds[:, None]

    def check(self, slots: np.ndarray, seeds: np.ndarray) -> np.ndarray:
        """Indices (into slots) of blocks whose bytes are not what they must be."""
        if not len(slots):
            return np.empty(0, dtype=np.int64)
        ok = (self.words[slots] == self._base + seeds[:, None]).all(axis=1)
        return np.flatnonzero(~ok)


def seeds_of(hashes: list[int]) -> np.ndarray:
    return np.array(hashes, dtype=np.uint64).view(np.int64)
