"""What the manager and worker of one process share: counters, the
back-off, and keys the worker found gone or corrupt (so the manager stops
answering HIT for them before its cached answer expires)."""

from __future__ import annotations

import threading
from collections import deque

from kvoffload.tiers.remote.connection import Backoff
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
    def __init__(self, cfg: RemoteConfig):
        self.counters = Counters()
        self.backoff = Backoff(cfg.backoff_initial_s, cfg.backoff_max_s)
        # offload keys a load found missing/corrupt; bounded, since a worker
        # process without a manager never drains it
        self.gone_keys: deque[bytes] = deque(maxlen=1 << 16)
        self.worker_queue_blocks = 0  # gauge, written by the worker
