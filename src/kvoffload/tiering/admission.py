"""Admission filters for slow tiers: store a block only once it has shown
it is worth the write.

Most offloaded blocks are never reused (76% of the Mooncake trace's blocks
are seen once), and a write to disk or a remote store costs bandwidth that
the blocks that are reused need. A filter sees every offer of a key and
answers which of the offered keys to admit.

- StoreCountAdmission: admit a key on its `threshold`-th offer. Exact
  counts of recently offered keys, kept in two generations of dicts (memory
  bounded by `memory` keys).
- TinyLFUAdmission (Einziger et al.): a doorkeeper set absorbs first
  offers, then a count-min sketch counts; admit when the estimate reaches
  `threshold`. All counts halve every `sample` offers, so old popularity
  fades. Fixed memory whatever the key count.

With `prefix_closed` (the default) `admit` admits only the leading run of
admitted keys of one call: under prefix semantics a block whose parent was
refused is useless.

The tiering manager gives each secondary tier with `admission: <name>` in
its config (or a `store_threshold` above 1: "store_count") one filter. It
offers a chunk when the engine stores it in CPU and when a request reuses
it (`offer`), and writes it down once `admitted` (when its CPU store lands,
or at the reuse that admits it).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from kvoffload.config import ConfigError
from kvoffload.registry import Registry


def _positive_int(owner: str, name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{owner}: {name} must be a positive integer, got {value!r}")
    return value


class AdmissionFilter(ABC):
    def __init__(self, prefix_closed: bool = True):
        self.prefix_closed = prefix_closed

    @abstractmethod
    def _offer(self, key: bytes) -> bool:
        """Record one offer of key; True if it is admitted now."""

    @abstractmethod
    def admitted(self, key: bytes) -> bool:
        """True if key is admitted now (records nothing)."""

    @abstractmethod
    def clear(self) -> None:
        """Forget every offer (a cache reset)."""

    def offer(self, keys: list[bytes]) -> list[bytes]:
        """Record one offer of each key; return those admitted by this offer
        (not admitted before it), so a caller writes each down once."""
        out = []
        for k in keys:
            before = self.admitted(k)
            if self._offer(k) and not before:
                out.append(k)
        return out

    def admit(self, keys: list[bytes]) -> list[bytes]:
        """Record an offer of each key (prefix order); return those to store."""
        out = []
        for k in keys:
            if self._offer(k):
                out.append(k)
            elif self.prefix_closed:
                for rest in keys[len(out) + 1:]:  # still counted as offered
                    self._offer(rest)
                break
        return out


class StoreCountAdmission(AdmissionFilter):
    def __init__(self, threshold: int = 2, memory: int = 1 << 20, prefix_closed: bool = True):
        super().__init__(prefix_closed)
        self.threshold = _positive_int("StoreCountAdmission", "threshold", threshold)
        self.generation = max(1, _positive_int("StoreCountAdmission", "memory", memory) // 2)
        self.counts: dict[bytes, int] = {}
        self.old: dict[bytes, int] = {}

    def _offer(self, key: bytes) -> bool:
        return self._offer_count(key) >= self.threshold

    def admitted(self, key: bytes) -> bool:
        c = self.counts.get(key)
        if c is None:
            c = self.old.get(key, 0)
        return c >= self.threshold

    def clear(self) -> None:
        self.counts, self.old = {}, {}

    def offer(self, keys: list[bytes]) -> list[bytes]:
        # the base's, without its admitted() pass: reaching the threshold is admission
        offer, threshold = self._offer_count, self.threshold
        return [k for k in keys if offer(k) == threshold]

    def _offer_count(self, key: bytes) -> int:
        c = self.counts.get(key)
        if c is None:
            c = self.old.pop(key, 0)
        c += 1
        self.counts[key] = c
        if len(self.counts) >= self.generation:
            self.old, self.counts = self.counts, {}
        return c


class TinyLFUAdmission(AdmissionFilter):
    DEPTH = 4

    def __init__(self, threshold: int = 2, width: int = 1 << 16, sample: int | None = None,
                 prefix_closed: bool = True):
        super().__init__(prefix_closed)
        self.threshold = _positive_int("TinyLFUAdmission", "threshold", threshold)
        self.width = _positive_int("TinyLFUAdmission", "width", width)
        self.sample = _positive_int("TinyLFUAdmission", "sample", sample if sample is not None else 8 * width)
        self.table = np.zeros((self.DEPTH, self.width), dtype=np.uint16)
        self.doorkeeper: set[bytes] = set()
        self.offers = 0

    def _cells(self, key: bytes) -> list[int]:
        h = hash(key)
        h1, h2 = h & 0xFFFFFFFF, (h >> 32) | 1
        return [(h1 + i * h2) % self.width for i in range(self.DEPTH)]

    def estimate(self, key: bytes) -> int:
        t = self.table
        est = min(int(t[i, c]) for i, c in enumerate(self._cells(key)))
        return est + (key in self.doorkeeper)

    def _offer(self, key: bytes) -> bool:
        self.offers += 1
        if self.offers >= self.sample:  # age: halve everything
            self.table >>= 1
            self.doorkeeper.clear()
            self.offers = 0
        if key not in self.doorkeeper:
            self.doorkeeper.add(key)
        else:
            t = self.table
            cells = self._cells(key)
            low = min(int(t[i, c]) for i, c in enumerate(cells))
            if low < 0xFFFF:
                for i, c in enumerate(cells):  # conservative update
                    if t[i, c] == low:
                        t[i, c] = low + 1
        return self.estimate(key) >= self.threshold

    def admitted(self, key: bytes) -> bool:
        return self.estimate(key) >= self.threshold

    def clear(self) -> None:
        self.table[:] = 0
        self.doorkeeper.clear()
        self.offers = 0


# name -> class, for a secondary tier's `admission` key
ADMISSION_FILTERS = Registry(AdmissionFilter, "admission filter", "filters",
                             {"store_count": StoreCountAdmission, "tinylfu": TinyLFUAdmission})


def make_admission(name: object, threshold: int | None, where: str) -> AdmissionFilter:
    """The filter named `name` (a registered name or "module:Class"), with
    `threshold` if given; ConfigError naming `where` otherwise. Built with
    prefix_closed=False: a tier is offered a store job's keys, not one
    request's prefix in order."""
    try:
        cls = ADMISSION_FILTERS.get(name)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    kw = {"prefix_closed": False}
    if threshold is not None:
        kw["threshold"] = threshold
    return cls(**kw)
