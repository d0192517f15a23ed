"""A replay through a remote tier whose server dies a quarter of the way in
(the Redis and Mooncake tiered tests share it)."""

from __future__ import annotations

import threading
import time


def replay_through_a_kill(engine, num_requests: int, kill, tier: str):
    """Run the engine in a thread, call kill() once a quarter of the requests
    ran, and return its result: it must finish (no hang), every request
    served, no wrong byte, and the tier's losses counted."""
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", engine.run()))
    t.start()
    while engine.c["requests"] < num_requests // 4 and t.is_alive():
        time.sleep(0.005)
    assert t.is_alive(), "the replay finished before the kill"
    kill()
    t.join(timeout=600)  # generous: a loaded machine; a hang is what this bounds
    assert not t.is_alive(), "replay hung after the server died"
    engine.close()
    r = out["r"]
    c = r.tiers[tier]["counters"]
    assert r.counters["requests"] == num_requests and r.counters["verify_failures"] == 0
    assert c.get("stores_refused", 0) + c.get("store_failures", 0) + c.get("dropped_stores", 0) > 0
    return r
