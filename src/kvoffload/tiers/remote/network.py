"""What every remote tier's network code shares: the errors that mean
"unreachable or too slow" (a miss, never a crash) and the back-off that
keeps one process's threads off the network after failures."""

from __future__ import annotations

import threading
import time

import redis

# Errors that mean "the server is unreachable or too slow": a miss, not a crash.
NETWORK_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError)


class Backoff:
    """Exponential back-off after network failures, shared by the threads
    of one process. While backing off nobody touches the network, so a
    dead server costs nothing but misses."""

    def __init__(self, initial_s: float, max_s: float):
        self.initial_s = initial_s
        self.max_s = max_s
        self._lock = threading.Lock()
        self._delay = 0.0
        self._retry_at = 0.0
        self.failures = 0  # consecutive
        self.total_failures = 0
        self.reconnects = 0  # recoveries after a failure

    def available(self) -> bool:
        """True if the network may be tried now."""
        return time.monotonic() >= self._retry_at

    @property
    def is_down(self) -> bool:
        return self.failures > 0

    def failed(self) -> None:
        with self._lock:
            self.failures += 1
            self.total_failures += 1
            self._delay = self.initial_s if self._delay == 0 else min(self._delay * 2, self.max_s)
            self._retry_at = time.monotonic() + self._delay

    def succeeded(self) -> None:
        if self.failures == 0:
            return
        with self._lock:
            if self.failures:
                self.reconnects += 1
            self.failures = 0
            self._delay = 0.0
            self._retry_at = 0.0
