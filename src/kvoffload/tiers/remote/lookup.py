"""Existence checks off the scheduler thread.

The manager queues keys it has no fresh answer for and answers RETRY; this
thread waits a moment so the keys looked up during one scheduler step go
out together (or until on_schedule_end flushes), sends one pipeline of
EXISTS, and leaves (key, present) answers in `results` for the manager to
pick up. present is None when the server could not be asked or answered
with an error; the manager takes that as a short-lived miss. The thread
survives any exception (answering None for that round's keys), and logs
at most one warning per WARN_EVERY_S: a server that errs on every round
would otherwise write hundreds of lines a second.

`busy_since` says since when the current round has been waiting on the
server (0.0: not waiting), so the manager can stop queueing lookups
behind a server that does not answer (see lookup_deadline_s).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

import redis

from kvoffload.tiers.remote.network import NETWORK_ERRORS
from kvoffload.tiers.remote.state import SharedState
from kvoffload.tiers.remote.value import KeySpace

log = logging.getLogger(__name__)

PIPELINE_KEYS = 4096  # EXISTS per pipeline round
WARN_EVERY_S = 10.0
# Failures that mean the server or cluster cannot be asked now: back off.
# redis-py's cluster errors (e.g. RedisClusterUnreachableError once every
# node is down) derive from Exception, not RedisError.
UNREACHABLE = (*NETWORK_ERRORS, redis.exceptions.RedisClusterException)


class ExistenceChecker:
    tier_name = "remote"  # in log lines

    def __init__(self, client, keyspace: KeySpace, state: SharedState, coalesce_s: float):
        self._client = client
        self._keyspace = keyspace
        self._state = state
        self._coalesce_s = coalesce_s
        self._queue: deque[bytes] = deque()
        self.results: deque[tuple[bytes, bool | None]] = deque()
        self._wake = threading.Event()
        self._flush = threading.Event()
        self._stopping = False
        self.busy_since = 0.0
        self._warned_at = float("-inf")
        self._unwarned = 0  # warnings left out since the last one logged
        self._thread = threading.Thread(target=self._run, name="kvoffload-remote-lookup", daemon=True)
        self._thread.start()

    def ask(self, key: bytes) -> None:
        self._queue.append(key)
        if not self._wake.is_set():
            self._wake.set()

    def flush(self) -> None:
        """End of a scheduler step: check what was queued now."""
        if self._queue:
            self._flush.set()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self._flush.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            self._wake.wait()
            if self._stopping:
                return
            self._flush.wait(self._coalesce_s)
            # clear before draining: a key queued after the drain sets _wake again
            self._wake.clear()
            self._flush.clear()
            keys = []
            while self._queue:
                keys.append(self._queue.popleft())
            for i in range(0, len(keys), PIPELINE_KEYS):
                batch = keys[i : i + PIPELINE_KEYS]
                try:
                    self._check(batch)
                except Exception as e:  # noqa: BLE001 - whatever it was, lookups must go on being answered
                    self.warn("%s lookup failed: %r", self.tier_name, e)
                    self.results.extend((k, None) for k in batch)
                finally:
                    self.busy_since = 0.0

    def warn(self, msg: str, *args) -> None:
        """log.warning, at most once per WARN_EVERY_S (the rest are counted)."""
        now = time.monotonic()
        if now - self._warned_at < WARN_EVERY_S:
            self._unwarned += 1
            return
        if self._unwarned:
            msg, args = msg + " (%d more such warnings left out)", (*args, self._unwarned)
        self._warned_at, self._unwarned = now, 0
        log.warning(msg, *args)

    def _server_keys(self, keys: list[bytes]) -> tuple[list[bytes], list[bytes]]:
        """(keys, their server keys), less any key that is not bytes: that one
        is answered absent, and the good keys beside it are still asked."""
        try:
            return keys, self._keyspace.redis_keys(keys)
        except (AttributeError, TypeError):
            self.results.extend((k, False) for k in keys if not isinstance(k, bytes))
            good = [k for k in keys if isinstance(k, bytes)]
            return good, self._keyspace.redis_keys(good)

    def _check(self, keys: list[bytes]) -> None:
        backoff = self._state.backoff
        if not backoff.available():
            self.results.extend((k, None) for k in keys)
            return
        keys, rkeys = self._server_keys(keys)
        self.busy_since = time.monotonic()
        try:
            pipe = self._client.pipeline(transaction=False)
            for rk in rkeys:
                pipe.exists(rk)
            answers = pipe.execute()
        except UNREACHABLE as e:
            backoff.failed()
            log.debug("remote lookup failed: %s", e)
            self.results.extend((k, None) for k in keys)
            return
        except redis.RedisError as e:  # an error reply (NOPERM, BUSY, CLUSTERDOWN, TRYAGAIN): unknown
            self.warn("remote lookup error: %s", e)
            self.results.extend((k, None) for k in keys)
            return
        backoff.succeeded()
        self.results.extend(zip(keys, (bool(a) for a in answers)))
