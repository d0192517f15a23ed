"""Steady streaming load on one server, for the soak: client threads send
shared-prefix prompts as streamed completions and record, per request, its
start, time to first token, the longest gap between two streamed chunks,
its end and whether it failed. The load pauses on request (drains what is
in flight) so probes can run alone.
"""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.request
from dataclasses import dataclass


@dataclass
class RequestRecord:
    start: float
    ttft_s: float | None
    max_gap_s: float
    end: float
    ok: bool
    error: str = ""


def stream_completion(base_url: str, model: str, prompt: list[int], max_tokens: int, timeout_s: float = 600
                      ) -> RequestRecord:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    req = urllib.request.Request(base_url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    start = time.monotonic()
    last, first, max_gap, tokens = start, None, 0.0, 0
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    raise RuntimeError(str(chunk["error"])[:200])
                now = time.monotonic()
                if first is None:
                    first = now - start
                else:
                    max_gap = max(max_gap, now - last)
                last = now
                tokens += 1
        ok = tokens > 0
        return RequestRecord(start, first, max_gap, time.monotonic(), ok, "" if ok else "no tokens")
    except Exception as e:  # a failed request is a result, not a crash of the load
        return RequestRecord(start, first, max_gap, time.monotonic(), False, f"{type(e).__name__}: {e}"[:200])


class Load:
    """`clients` threads, each sending prompts built from `num_prefixes`
    shared prefixes with fresh suffixes, back to back."""

    def __init__(self, base_url: str, model: str, vocab: int, clients: int, num_prefixes: int, prefix_len: int,
                 suffix_len: int, max_tokens: int, seed: int = 0):
        self.base_url, self.model, self.max_tokens = base_url, model, max_tokens
        rng = random.Random(seed)
        self.vocab = vocab
        self.prefixes = [[rng.randrange(16, vocab - 16) for _ in range(prefix_len)] for _ in range(num_prefixes)]
        self.suffix_len = suffix_len
        self.records: list[RequestRecord] = []
        self._lock = threading.Lock()
        self._running = threading.Event()
        self._stop = threading.Event()
        self._idle = [threading.Event() for _ in range(clients)]
        self._threads = [threading.Thread(target=self._loop, args=(i, seed + 1 + i), daemon=True)
                         for i in range(clients)]

    def start(self) -> None:
        self._running.set()
        for t in self._threads:
            t.start()

    def _loop(self, i: int, seed: int) -> None:
        rng = random.Random(seed)
        while not self._stop.is_set():
            if not self._running.is_set():
                self._idle[i].set()
                self._running.wait(0.2)
                continue
            self._idle[i].clear()
            prompt = rng.choice(self.prefixes) + [rng.randrange(16, self.vocab - 16) for _ in range(self.suffix_len)]
            rec = stream_completion(self.base_url, self.model, prompt, self.max_tokens)
            with self._lock:
                self.records.append(rec)

    def pause(self, timeout_s: float = 600) -> None:
        """Stop sending and wait until every client's request in flight ended."""
        self._running.clear()
        deadline = time.monotonic() + timeout_s
        for ev in self._idle:
            ev.wait(max(0.0, deadline - time.monotonic()))

    def resume(self) -> None:
        self._running.set()

    def stop(self) -> None:
        self._stop.set()
        self._running.set()
        for t in self._threads:
            t.join(timeout=600)

    def snapshot(self) -> list[RequestRecord]:
        with self._lock:
            return list(self.records)
