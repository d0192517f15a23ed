"""The simulated GPU side of a replay: a KV tensor of block slots and the
GPU prefix cache over it (block contents: replay/contents.py).

Bookkeeping is per request, not per block, where it can be: refcounts and
free slots in numpy arrays (a request's slots are one int64 array from
allocation to release: no list<->array conversions), slot<->hash maps
filled and emptied with dict operations.
"""

from __future__ import annotations

from collections import OrderedDict
from functools import partial
from itertools import repeat
from operator import is_not

import numpy as np
import torch


class GPUBlocks:
    """num_blocks slots of page_bytes on a plain CPU tensor (the "GPU").

    Slots in use by running requests are refcounted; a released slot with a
    hash stays cached (idle) for later prefix hits, at most `cache_blocks`
    of them, least recently used evicted first.
    """

    def __init__(self, num_blocks: int, page_bytes: int, cache_blocks: int, shared: bool = True):
        """shared=False: no request can ever reuse another's blocks (no cache
        and one request at a time), so hashes are not tracked at all."""
        if page_bytes % 8:
            raise ValueError(f"GPU page size must be a multiple of 8 bytes, got {page_bytes}")
        self.tensor = torch.zeros((num_blocks, page_bytes), dtype=torch.uint8)
        self.words = self.tensor.numpy().view(np.int64)  # (num_blocks, page_bytes // 8)
        self.cache_blocks = cache_blocks
        self.track = shared or cache_blocks > 0
        self.is_free = np.ones(num_blocks, dtype=bool)
        self.num_free = num_blocks
        self.slot_of: dict[int, int] = {}  # block hash -> slot (in use or idle)
        self.hash_of: dict[int, int] = {}  # slot -> block hash (slots with one)
        self.refs = np.zeros(num_blocks, dtype=np.int64)
        self.idle: OrderedDict[int, int] = OrderedDict()  # hash -> slot, least recent first
        self.evictions = 0

    # ---- prefix cache -------------------------------------------------------

    def match(self, hashes: list[int]) -> int:
        """Length of the leading run of hashes cached on the GPU."""
        slot_of = self.slot_of
        if not slot_of:
            return 0
        n = 0
        for h in hashes:
            if h not in slot_of:
                break
            n += 1
        return n

    def acquire(self, hashes: list[int]) -> list[int]:
        """Take a reference on cached blocks (a GPU prefix hit)."""
        slots = []
        refs, idle, slot_of = self.refs, self.idle, self.slot_of
        for h in hashes:
            s = slot_of[h]
            if refs[s] == 0:
                del idle[h]
            refs[s] += 1
            slots.append(s)
        return slots

    def can_allocate(self, n: int, hits: list[int]) -> bool:
        """Whether n fresh slots can be had once the cached blocks `hits`
        are acquired (vLLM's allocate_slots check: an idle hit block is not
        free for this request, since it is about to take it)."""
        room = self.num_free
        if room >= n:
            return True
        room += len(self.idle)
        if room >= n and hits:
            room -= len(self.idle.keys() & hits)
        return room >= n

    def allocate(self, n: int) -> np.ndarray | None:
        """n fresh slots (int64, ascending), evicting idle cached blocks if
        needed; None (and nothing evicted) if the running requests hold too
        many. A caller with GPU hits checks can_allocate and acquires them
        first, so they are not evicted for its own fresh blocks."""
        if self.num_free + len(self.idle) < n:
            return None
        while self.num_free < n:
            h, s = self.idle.popitem(last=False)
            del self.slot_of[h]
            del self.hash_of[s]
            self._free(s)
            self.evictions += 1
        # The n lowest free slots, ascending: a request's blocks then lie in
        # one stretch of the tensor whenever the free slots allow (always with
        # one request at a time), so its fills and copies run over contiguous
        # rows. Which slot a block gets changes no hit and no byte.
        slots = np.flatnonzero(self.is_free)[:n].astype(np.int64, copy=False)
        self.is_free[slots] = False
        self.num_free -= n
        self.refs[slots] = 1
        return slots

    def _free(self, s: int) -> None:
        self.is_free[s] = True
        self.num_free += 1

    def register(self, slots: np.ndarray, hashes: list[int]) -> None:
        """Computed or loaded blocks become prefix-cache hits (the first slot
        of a hash listed twice; a hash or slot that has one already keeps it)."""
        if not self.track:
            return
        slots = slots.tolist()
        new = dict(zip(reversed(hashes), reversed(slots)))  # reversed: the first slot wins
        slot_of, hash_of = self.slot_of, self.hash_of
        for h in new.keys() & slot_of.keys():
            del new[h]
        if hash_of and not hash_of.keys().isdisjoint(new.values()):
            new = {h: s for h, s in new.items() if s not in hash_of}
        slot_of.update(new)
        hash_of.update(zip(new.values(), new.keys()))

    def release(self, slots) -> None:
        """Drop a reference on each slot (each listed once); the last one
        makes a slot free, or an idle cache entry if it has a hash. Idle
        entries are ranked in the order given (vLLM frees a request's tail
        first)."""
        if not len(slots):
            return
        refs = self.refs
        idx = np.asarray(slots, dtype=np.int64)
        refs[idx] -= 1
        done = idx[refs[idx] == 0]
        if not len(done):
            return
        hash_of, slot_of, cap = self.hash_of, self.slot_of, self.cache_blocks
        if not cap:  # no prefix cache: every slot is simply free again
            if hash_of:
                hashes = list(filter(partial(is_not, None), map(hash_of.pop, done.tolist(), repeat(None))))
                for h in hashes:
                    del slot_of[h]
            self.is_free[done] = True
            self.num_free += len(done)
            return
        idle = self.idle
        for s in done.tolist():
            h = hash_of.get(s)
            if h is None:
                self._free(s)
                continue
            idle[h] = s
            if len(idle) > cap:
                h2, s2 = idle.popitem(last=False)
                del slot_of[h2]
                del hash_of[s2]
                self._free(s2)
                self.evictions += 1
