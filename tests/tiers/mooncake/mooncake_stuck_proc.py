"""Shut down while a load is stuck on a paused store node, in a process of
its own (the client used to be closed under the stuck call: SIGSEGV):

    python mooncake_stuck_proc.py tier|sglang MASTER METADATA PREFIX

prints 'stored', waits for a line on stdin (the parent pauses the store
node first), starts a load on a thread, shuts the tier (or the SGLang
backend) down, prints 'survived', and once told the node runs again (a
second line) waits for the stuck call to return (its IO thread to end) and
prints 'load returned'.
"""

import subprocess
import sys
import threading
import time
from pathlib import Path

from kvoffload.tiers.remote.process import pause, resume

from mooncake_engine_proc import _Srv
from mooncake_helpers import fill, keys_for, load, make_tier, store

# past the worker's 10 s wait for its IO threads: the load is still inside the client at shutdown
STUCK = dict(transfer_timeout_s=60.0)


def tier_case(srv: _Srv, prefix: str):
    tier, m, w, pool = make_tier(srv, prefix, num_chunks=8, **STUCK)
    keys = keys_for(4, seed=5)
    fill(pool, range(4), seed=5)
    assert store(m, w, keys, [0, 1, 2, 3])
    return lambda: load(m, w, keys, [4, 5, 6, 7]), tier.shutdown, w


def sglang_case(srv: _Srv, prefix: str):
    sys.path.insert(0, str(Path(__file__).parents[2] / "integrations" / "sglang"))
    from sglang_backend_rig import keys, make_backend, pages

    section = {"type": "mooncake", **srv.tier_config(key_prefix=prefix, segment_bytes=0, **STUCK)}
    backend, pool = make_backend(section)
    pool.fill_random(1)
    ks = keys(4, salt=prefix)
    assert backend.batch_set_v1(ks, pages(0, 1, 2, 3)) == [True] * 4
    return lambda: backend.batch_get_v1(ks, pages(4, 5, 6, 7)), backend.close, backend.io.worker


def run_stuck_shutdown(srv, prefix: str, case: str) -> tuple[int, str]:
    """mooncake_stuck_proc.py: stores, then (with the store node paused) shuts down during a load."""
    proc = subprocess.Popen([sys.executable, __file__, case, srv.master_address, srv.metadata_server,
                             prefix], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    out = ""
    try:
        out += proc.stdout.readline()
        assert out == "stored\n", proc.stderr.read()[-3000:] if proc.poll() is not None else out
        pause(srv.node)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        out += proc.stdout.readline()  # "survived", or nothing if it crashed
        resume(srv.node)  # the stuck call returns now, into the client it was using
        rest, err = proc.communicate("resumed\n", timeout=120)
        return proc.returncode, out + rest + err[-3000:]
    finally:
        resume(srv.node)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def main(case: str, master: str, metadata: str, prefix: str) -> int:
    get, close, worker = (tier_case if case == "tier" else sglang_case)(_Srv(master, metadata), prefix)
    print("stored", flush=True)
    sys.stdin.readline()
    threading.Thread(target=get, daemon=True).start()
    time.sleep(1.0)  # the load is inside the client, waiting on the paused node
    close()
    print("survived", flush=True)
    sys.stdin.readline()  # the node runs again: live on until the stuck call has returned (an IO thread
    deadline = time.monotonic() + 90  # ends once its call is back: the queue is closed)
    while any(t.is_alive() for t in worker._threads) and time.monotonic() < deadline:
        time.sleep(0.05)
    print("load returned" if time.monotonic() < deadline else "load still stuck", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:5]))
