"""What the manager and worker of one process share: counters, the
back-off(s), and keys the worker found gone or corrupt (so the manager stops
answering HIT for them before its cached answer expires)."""

from __future__ import annotations

import threading
from collections import deque

from kvoffload.tiers.remote.network import Backoff
from kvoffload.tiers.remote.config import RemoteConfig


class Counters:
    """Thread-safe counters; take() returns the deltas since the last take."""

    def __init__(self):
        self._lock = threading.Lock()
        self._c: dict[str, float] = {}

    def add(self, name: str, n: float = 1) -> None:
        with self._lock:
            self._c[name] = self._c.get(name, 0) + n

    def take(self) -> dict[str, float]:
        with self._lock:
            c, self._c = self._c, {}
        return c


class SharedState:
    def __init__(self, cfg: RemoteConfig, separate_transfers: bool = False):
        """separate_transfers: lookups and transfers back off apart (Mooncake:
        the master answers lookups while a store node that holds the values
        is down, so a lookup that succeeds says nothing of the node, and must
        not end the transfers' back-off). Redis: one server, one back-off."""
        self.counters = Counters()
        self.backoff = Backoff(cfg.backoff_initial_s, cfg.backoff_max_s)  # lookups (and transfers if shared)
        self.transfer_backoff = Backoff(cfg.backoff_initial_s, cfg.backoff_max_s) if separate_transfers \
            else self.backoff
        # offload keys a load found missing/corrupt; bounded, since a worker
        # process without a manager never drains it
        self.gone_keys: deque[bytes] = deque(maxlen=1 << 16)
        self.worker_queue_blocks = 0  # gauge, written by the worker

    def available(self) -> bool:
        """Neither back-off is waiting: the network may be tried."""
        transfers = self.transfer_backoff
        return self.backoff.available() and (transfers is self.backoff or transfers.available())

    @property
    def is_down(self) -> bool:
        return self.backoff.is_down or self.transfer_backoff.is_down

    @property
    def reconnects(self) -> int:
        if self.transfer_backoff is self.backoff:
            return self.backoff.reconnects
        return self.backoff.reconnects + self.transfer_backoff.reconnects
