"""vLLM's `store_threshold` on the CPU tier: a chunk is stored only once it
has been offered `threshold` times (vLLM's CPUOffloadingManager counts each
prepare_store offer of a key, in an LRU tracker of max_tracker_size keys).
Where nothing is reused, no chunk reaches the threshold and nothing is
copied out of vLLM's cache.

One difference from vLLM: the cut is prefix-closed. Once one new chunk of an
offer is refused, the new chunks after it are refused too (every offer is
still counted): a lookup stops at a request's first miss, so a chunk
stored behind a missing parent is never served.

Only the plain CPU spec wraps its manager so: the tiered spec promotes
blocks into the CPU tier through the same prepare_store.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from kvoffload.abstractions import OffloadingStats, PrepareStoreOutput
from kvoffload.policies.admission import StoreCountAdmission

DEFAULT_TRACKER_KEYS = 64_000  # vLLM's max_tracker_size default


class StoreThresholdManager:
    """The CPU manager, storing a new chunk only on its threshold-th offer.
    Every other call goes to the wrapped manager as is."""

    def __init__(self, inner: Any, threshold: int, tracker_keys: int = DEFAULT_TRACKER_KEYS):
        self._inner = inner
        self.store_threshold = threshold
        # two generations of tracker_keys / 2 exact counts (at least tracker_keys remembered)
        self._counts = StoreCountAdmission(threshold, memory=2 * tracker_keys, prefix_closed=True)
        self._skipped = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def prepare_store(self, keys: Collection, req_context: Any = None) -> PrepareStoreOutput | None:
        stored = self._inner.slot_of
        kept, cut = [], False
        for key in keys:
            if stored(key) is not None:  # already here: the manager keeps it (and protects it)
                kept.append(key)
                continue
            seen_enough = self._counts._offer(key)  # counted whether or not it is cut
            if cut or not seen_enough:
                cut = True
                self._skipped += 1
                continue
            kept.append(key)
        return self._inner.prepare_store(kept, req_context)

    def get_stats(self) -> OffloadingStats:
        stats = self._inner.get_stats()
        stats.counters["dropped_stores"] = stats.counters.get("dropped_stores", 0) + self._skipped
        self._skipped = 0
        return stats
