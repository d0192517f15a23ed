"""The threads that hash beside the Mooncake tier's transfers: checks of
loaded values first (a request waits on them), then headers of values to
store (background).

Hashing that nothing overlaps (a lone store job's headers, made before its
first put; a last round's check, after its get) is cut into pieces, one
per thread (each at least MIN_PIECE_BYTES), so it runs on every core that
is free (xxh3 releases the GIL). Hashing that overlaps a transfer stays in
one piece: split, it would take both cores from the transfer at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from kvoffload.tiers.base import even_runs

log = logging.getLogger(__name__)

# A piece smaller than this costs more in hand-offs than a second core saves.
MIN_PIECE_BYTES = 2 << 20


class HashThreads:
    def __init__(self, threads: int, name: str = "kvoffload-mooncake-hash"):
        self._cond = threading.Condition()
        self._urgent: deque = deque()  # checks of loaded values
        self._background: deque = deque()  # headers of values to store
        self._busy_background = 0  # background pieces taken, not finished
        self._stopping = False
        self.threads = [threading.Thread(target=self._run, name=f"{name}{i}", daemon=True) for i in range(threads)]
        for t in self.threads:
            t.start()

    def pieces(self, n: int, item_bytes: int) -> list[tuple[int, int]]:
        """[a, b) runs of n items, one per thread that gets >= MIN_PIECE_BYTES."""
        k = max(1, min(len(self.threads), n * item_bytes // MIN_PIECE_BYTES, n))
        return even_runs(n, k)

    def run_soon(self, tasks: list[Callable[[], None]], urgent: bool) -> None:
        """Run each task on some thread; urgent ones before any background one.
        A task must not raise (it reports its own failures)."""
        with self._cond:
            (self._urgent if urgent else self._background).extend(tasks)
            self._cond.notify(len(tasks))

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._urgent or self._background or self._stopping):
                    self._cond.wait()
                if self._urgent:
                    task, background = self._urgent.popleft(), False
                elif self._background:
                    task, background = self._background.popleft(), True
                    self._busy_background += 1
                else:
                    return
            try:
                task()
            except Exception:  # noqa: BLE001 - tasks report their own failures; this one is a bug
                log.exception("mooncake: a hashing task failed")
            if background:
                with self._cond:
                    self._busy_background -= 1
                    self._cond.notify_all()

    def wait_background(self, timeout_s: float) -> None:
        """Until every background task queued so far has run (or timeout_s)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._background or self._busy_background:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._cond.wait(left)

    def stop(self, timeout_s: float) -> None:
        """Run what is queued, then end the threads."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        for t in self.threads:
            t.join(timeout=timeout_s)
