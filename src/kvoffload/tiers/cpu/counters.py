"""The CPU manager's counters and gauges (get_stats). Mixed into
CPUOffloadingManager, which bumps the counters inline on its hot paths.

store_blocks_declined: new keys of an offer the eviction policy chose not to
store (the chain family's admission keeps a request's prefix whole) in an
answer that was not None. vLLM's connector moves past every key of such an
answer, so these blocks are never offered again: the cost of the policy's
choice, counted so a report can show it. (No room at all for an offer's new
keys is answered None instead: offered again next step.)"""

from __future__ import annotations

from kvoffload.abstractions import OffloadingStats
from kvoffload.hints import COUNTER as BAD_HINTS


class CPUCounters:
    def _zero_counters(self) -> None:
        self._misses = self._hits = self._hits_pending = 0
        self._stored = self._loaded = self._evictions = 0
        self._allocation_failures = self._dropped = 0
        self._declined = 0  # new keys the policy's admission left unstored, answering an offer
        self._bad_hints = 0

    def get_stats(self) -> OffloadingStats:
        used = self.num_chunks - len(self._free)
        bpc = self.chunk_bytes
        counters = {
            "lookups": self._hits + self._hits_pending + self._misses,
            "hits": self._hits,
            "misses": self._misses,
            "hits_pending": self._hits_pending,
            "stored_blocks": self._stored,
            "stored_bytes": self._stored * bpc,
            "loaded_blocks": self._loaded,
            "loaded_bytes": self._loaded * bpc,
            "evictions": self._evictions,
            "allocation_failures": self._allocation_failures,
            "dropped_stores": self._dropped,
            "store_blocks_declined": self._declined,
            BAD_HINTS: self._bad_hints,
        }
        gauges = {
            "used_blocks": used,
            "capacity_blocks": self.num_chunks,
            "pinned_blocks": self._num_pinned,
            "pending_blocks": self._num_pending,
            "usage": used / self.num_chunks,
            "queue_depth": self._num_pending,
            "fenced_blocks": len(self._fenced),
        }
        self._zero_counters()
        return OffloadingStats(tier=self.name, medium=self.medium, locality=self.locality,
                               counters=counters, gauges=gauges)
